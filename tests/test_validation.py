"""The catalogue of bad inputs: each is refused before any process starts, as one line.

Why a catalogue: a bad input found inside the workers costs a traceback per rank, or a
whole run lost at its first save; found by gridtrain.training.validate it costs one line
and exit status 2. Each entry below is data (the `gridtrain train` arguments, with
``{d}`` standing for a folder of prepared files, and a piece of the expected message),
run through ``cli.main`` in this process with one process and with ``--nproc 2`` while
starting a process group or spawning a worker fails the test. A few go through a real
``python -m gridtrain`` with ``--nproc 2`` to show that no traceback is printed and no
process is left behind. Good configurations (configs/*.yaml) must still pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from gridtrain import checkpoint
from gridtrain.cli import parser as cli
from gridtrain.training import validate as validate_config
from gridtrain.config import Config, ConfigError, load_config, preset_config
from gridtrain.data import prepare
from gridtrain.models.decoder import Decoder
from gridtrain.training.validate import field_name, validate

REPO = Path(__file__).resolve().parents[1]

# name -> (arguments after `gridtrain train`, a piece of the one-line message)
FLAGS = {
    "negative seed": (["--seed", "-1"], "--seed must be >= 0, got -1"),
    "negative timeout": (["--timeout", "-5"], "--timeout must be > 0"),
    "zero timeout": (["--timeout", "0"], "--timeout must be > 0"),
    "no validation batches": (["--eval-iters", "0"], "use --eval-interval 0 to turn validation off"),
    "negative eval interval": (["--eval-interval", "-1"], "--eval-interval must be >= 0"),
    "negative save interval": (["--save-interval", "-1"], "--save-interval must be >= 0"),
    "zero global batch": (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    "zero micro-batch": (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    "negative grad clip": (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    "negative weight decay": (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    "negative warm-up": (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    "negative sample": (["--sample-tokens", "-1"], "--sample-tokens must be >= 0"),
    "zero loss scale": (["--loss-scale", "0"], "--loss-scale must be > 0"),
    "zero minimum loss scale": (["--min-loss-scale", "0"], "--min-loss-scale must be > 0"),
    "zero bucket": (["--bucket-mb", "0"], "--bucket-mb must be > 0"),
    "zero steps": (["--steps", "0"], "--steps must be >= 1"),
    "zero learning rate": (["--lr", "0"], "--lr must be > 0"),
    "dropout of one": (["--dropout", "1"], "--dropout must be in [0, 1)"),
    "zero tp": (["--tp", "0"], "--tp must be >= 1, got 0"),
    "zero pp": (["--pp", "0"], "--pp must be >= 1, got 0"),
    "zero dp": (["--dp", "0"], "--dp must be >= 1, got 0"),
    "zero vpp": (["--vpp", "0"], "--vpp must be >= 1, got 0"),
    "dp beyond the world": (["--dp", "3"], "dp=3 x pp=1 x tp=1 = 3 does not equal world size"),
    "zero layers": (["--n-layer", "0"], "--n-layer must be >= 1, got 0"),
    "zero sequence": (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    "negative peak": (["--peak-tflops", "-1"], "--peak-tflops must be > 0"),
    "zero recompute layers": (["--recompute", "full", "--recompute-layers", "0"], "--recompute-layers must be >= 1"),
    "unknown partition": (["--pp-partition", "random"], "--pp-partition 'random'"),
    "unknown attention": (["--attention", "flash"], "--attention 'flash'"),
    "unknown device": (["--device", "tpu"], "--device 'tpu'"),
    "zero four": (["--zero", "4"], "--zero 4 is not one of 0, 1, 2, 3"),
    "keep-gathered without zero 3": (["--zero", "2", "--zero3-keep-gathered"], "pass --zero 3 or drop it"),
    "shard size without zero": (["--zero-shard-size", "2"], "pass --zero 1, 2 or 3 or drop it"),
    "recompute early without pipeline": (["--recompute", "full", "--recompute-early"], "it needs --pp > 1"),
    "auto-resume without save": (["--auto-resume"], "--auto-resume resumes from the --save directory"),
    "seed beyond 64 bits": (["--seed", str(2 ** 63)], "--seed must be < 2**63"),
    "unknown architecture": (["--arch", "bert"], "--arch 'bert' is not one of gpt2, llama"),
    "kv heads not dividing heads": (["--model", "llama-tiny", "--n-kv-head", "3"],
                                    "--n-kv-head 3 does not divide --n-head 8"),
    "zero kv heads": (["--model", "llama-tiny", "--n-kv-head", "0"], "--n-kv-head must be >= 1, got 0"),
    "kv heads for GPT-2": (["--n-kv-head", "2"], "GPT-2 has one key/value head per query head"),
    "odd rotary head size": (["--model", "llama-tiny", "--d-model", "72"], "= 9 is odd; choose an even head size"),
    "zero rope theta": (["--model", "llama-tiny", "--rope-theta", "0"], "--rope-theta must be > 0"),
    "compile backend without compile": (["--compile-backend", "aot_eager"], "add --compile or drop --compile-backend"),
    "unknown compile backend": (["--compile", "--compile-backend", "cudagraphs"], "--compile-backend 'cudagraphs'"),
}

FIXED_WORLD = {  # the world is part of the case
    "shard size not dividing dp": (["--zero", "3", "--zero-shard-size", "3", "--nproc", "4"],
                                   "--zero-shard-size 3 does not divide the 4 data-parallel x cp ranks"),
    "a world far beyond the host": (["--nproc", "4096"], "lower --nproc to at most"),
    "zero workers": (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    "tp beyond the world": (["--tp", "4", "--nproc", "2"], "world size 2 is not divisible by tp=4"),
    "sequence parallel without divisible seq": (["--tp", "2", "--nproc", "2", "--seq-len", "33",
                                                 "--sequence-parallel"], "--tp 2 does not divide --seq-len 33"),
    "tp beyond kv heads, not a multiple": (["--model", "llama-tiny", "--n-head", "12", "--d-model", "96",
                                            "--n-kv-head", "4", "--tp", "6", "--nproc", "6"],
                                           "--tp 6 exceeds --n-kv-head 4 but is not a multiple of it"),
    "tp not dividing kv heads": (["--model", "llama-tiny", "--n-head", "12", "--d-model", "96",
                                  "--n-kv-head", "6", "--tp", "4", "--nproc", "4"],
                                 "--tp 4 does not divide --n-kv-head 6"),
    "cp beyond the world": (["--cp", "4", "--nproc", "2"], "world size 2 is not divisible by tp=1 x cp=4 x pp=1"),
    "cp with a sequence it cannot cut": (["--cp", "2", "--nproc", "2", "--seq-len", "66"],
                                         "--seq-len 66 is not divisible by 2 x cp = 4"),
    "cp and SP with a share tp cannot divide": (["--cp", "2", "--tp", "4", "--sequence-parallel", "--nproc", "8",
                                                 "--seq-len", "68"],
                                                "--tp 4 does not divide the 34 tokens each cp rank holds"),
    "cp with dropout": (["--cp", "2", "--nproc", "2", "--dropout", "0.1"], "use --dropout 0"),
    "unknown cp exchange": (["--cp", "2", "--nproc", "2", "--cp-comm", "alltoall"],
                            "--cp-comm 'alltoall' is not one of ring, allgather"),
}

DATA = {
    "missing data": (["--data", "{d}/nothing"], "--data {d}/nothing: no such file or directory"),
    "empty data file": (["--data", "{d}/empty.txt"], "the corpus is empty"),
    "binary data file": (["--data", "{d}/blob.dat"], "not UTF-8 text"),
    "token file without its header": (["--data", "{d}/headless.bin"], "needs its header {d}/headless.json"),
    "truncated token file": (["--data", "{d}/truncated.bin"], "but the header says"),
    "folder without text": (["--data", "{d}/binaries"], "no UTF-8 text files in this folder"),
    "empty folder": (["--data", "{d}/emptydir"], "no UTF-8 text files in this folder"),
    "data too small for a validation window": (["--data", "{d}/small.txt"], "needed for one validation window"),
    "sequence too long for the data": (["--data", "{d}/small.txt", "--seq-len", "2048"],
                                       "0 windows of --seq-len 2048"),
    "data smaller than one global batch": (["--data", "{d}/small.txt", "--seq-len", "4", "--global-batch-size", "400",
                                            "--micro-batch-size", "4"], "fewer than one global batch of 400"),
    "token file smaller than one global batch": (["--data", "{d}/tokens.bin", "--seq-len", "4", "--global-batch-size",
                                                  "400", "--micro-batch-size", "4"], "fewer than one global batch"),
    "too small by the tokenizer's bound": (["--data", "{d}/small.txt", "--tokenizer", "{d}/hf300.json",
                                            "--vocab-size", "300"], "at most 1200 tokens"),
    "token file from another tokenizer": (["--data", "{d}/tokens.bin", "--tokenizer", "{d}/hf300.json",
                                           "--vocab-size", "300"], "token file was made with tokenizer byte"),
    # ids past the model's vocabulary: a file written before headers recorded the largest id is scanned
    "token file with ids outside the vocabulary": (["--data", "{d}/wide.bin", "--seq-len", "4"],
                                                   "--data {d}/wide.bin: the token file holds ids up to 300, outside "
                                                   "--vocab-size 257; pass --vocab-size 301 or more"),
    "token file whose header records ids outside the vocabulary": (
        ["--data", "{d}/wide-header.bin", "--seq-len", "4"],
        "the token file holds ids up to 400, outside --vocab-size 257"),
    # every prompt longer than --seq-len: the truncation leaves no completion token (0 / 0 as a loss)
    "fine-tuning data with no loss-bearing token": (
        ["--data", "{d}/sft_long.jsonl", "--seq-len", "64", "--global-batch-size", "2", "--micro-batch-size", "1"],
        "--data {d}/sft_long.jsonl: no token of it counts in the loss at --seq-len 64 (200 of its 200 examples"),
    "validation data with no loss-bearing token": (
        ["--data", "{d}/small.txt", "--seq-len", "64", "--valid-data", "{d}/sft_long.jsonl"],
        "--valid-data {d}/sft_long.jsonl: no token of it counts in the loss at --seq-len 64"),
    "a mixture's fine-tuning source with no loss-bearing token": (
        ["--data", "0.5:{d}/sft_long.jsonl,0.5:{d}/small.txt", "--seq-len", "64"],
        "--data {d}/sft_long.jsonl: no token of it counts in the loss"),
}

TOKENIZERS = {
    "missing tokenizer": (["--tokenizer", "{d}/nothing.json"], "--tokenizer {d}/nothing.json: no such file"),
    "tokenizer that does not parse": (["--tokenizer", "{d}/notatokenizer.json"], "not a tokenizer.json file"),
    "tokenizer that is a folder": (["--tokenizer", "{d}/emptydir"], "no such file"),
    "tokenizer larger than the vocabulary": (["--tokenizer", "{d}/hf300.json"], "pass --vocab-size 300"),
    "vocabulary too small for bytes": (["--vocab-size", "200"], "pass --vocab-size 257"),
}

CHECKPOINTS = {
    "load of a missing directory": (["--load", "{d}/nothing"], "--load {d}/nothing: does not exist"),
    "load of a file": (["--load", "{d}/small.txt"], "is not a directory"),
    "load of a directory without a checkpoint": (["--load", "{d}/emptydir"], "no checkpoint there"),
    "latest names a missing step": (["--load", "{d}/latest-missing"], "names 'step_0000005', which does not exist"),
    "empty latest": (["--load", "{d}/latest-empty"], "latest is empty"),
    "checkpoint with fewer layers": (["--load", "{d}/ckpt", "--n-layer", "1"], "n_layer 2 (checkpoint) vs 1 (flags)"),
    "checkpoint with more heads": (["--load", "{d}/ckpt", "--n-head", "2"], "n_head 4 (checkpoint) vs 2 (flags)"),
    "auto-resume onto another model": (["--auto-resume", "--save", "{d}/ckpt", "--d-model", "32"],
                                       "d_model 64 (checkpoint) vs 32 (flags)"),
    "auto-resume onto a broken latest": (["--auto-resume", "--save", "{d}/latest-missing"],
                                         "names 'step_0000005', which does not exist"),
    "checkpoint without its shard file": (["--load", "{d}/ckpt-damaged"], "__0_0.distcp is missing"),
    "negative keep-last": (["--keep-last", "-1", "--save", "{d}/run"], "--keep-last must be >= 0, got -1"),
    "keep-last without save": (["--keep-last", "2"], "--keep-last prunes the --save directory; pass --save DIR"),
    "save-async without save": (["--save-async"], "--save-async writes checkpoints to --save; pass --save DIR"),
}

OUTPUTS = {
    "save onto a file": (["--save", "{d}/small.txt"], "--save {d}/small.txt: exists and is not a directory"),
    "save under a file": (["--save", "{d}/small.txt/run"], "is a file, not a directory"),
    "trace onto a file": (["--trace", "{d}/small.txt"], "--trace {d}/small.txt: exists and is not a directory"),
    "tensorboard under a file": (["--tensorboard", "{d}/small.txt/tb"], "is a file, not a directory"),
    "metrics file onto a folder": (["--metrics-file", "{d}/emptydir"], "is a directory; give a file path"),
    "metrics file under a file": (["--metrics-file", "{d}/small.txt/m.jsonl"], "is a file, not a directory"),
    "empty save path": (["--save", ""], "--save: empty path"),
}

# name -> (YAML text, a piece of the message); run as `--config {d}/yaml/<n>.yaml`
YAML = {
    "malformed YAML": ("training:\n  steps: [1,\nmodel: 3\n", "line 4, column 1"),
    "tab indentation": ("training:\n\tsteps: 3\n", "line 2"),
    "fractional steps": ("training: {steps: 2.5}\n", "training.steps must be an integer, got 2.5"),
    "steps in words": ("training: {steps: ten}\n", "training.steps must be an integer, got 'ten'"),
    "section that is a number": ("model: 5\n", "section model must be a mapping"),
    "section that is a list": ("parallel: [1, 2]\n", "section parallel must be a mapping"),
    "sample tokens in words": ("training: {sample_tokens: x}\n", "training.sample_tokens must be an integer"),
    "bool as a string": ("training: {progress: 'no'}\n", "training.progress must be true or false"),
    "learning rate in words": ("training: {lr: fast}\n", "training.lr must be a finite number, got 'fast'"),
    "learning rate not a number": ("training: {lr: .nan}\n", "training.lr must be a finite number"),
    "path as a number": ("data: {path: 7}\n", "data.path must be a string or null, got 7"),
    "layer split with a word": ("parallel: {pp_layers: [1, x]}\n", "parallel.pp_layers must be a list of integers"),
    "preset as a number": ("preset: 5\n", "preset must be a string, got 5"),
    "unknown preset": ("preset: gpt5\n", "unknown model preset 'gpt5'"),
    "unknown section": ("optimizer: {lr: 1}\n", "unknown section(s) ['optimizer']"),
    "unknown key": ("model:\n  n_layers: 3\n", "unknown key model.n_layers"),
    "numeric key": ("training: {1: 2}\n", "unknown key training.1"),
    "a list at the top": ("- preset\n", "expected a mapping with sections"),
    "beta of one": ("training: {beta2: 1.0}\n", "training.beta2 must be in [0, 1)"),
    "min lr ratio above one": ("training: {min_lr_ratio: 1.5}\n", "training.min_lr_ratio must be in [0, 1]"),
    "zero adam eps": ("training: {adam_eps: 0}\n", "training.adam_eps must be > 0"),
    "zero temperature": ("training: {temperature: 0}\n", "training.temperature must be > 0"),
    "zero top-k": ("training: {top_k: 0}\n", "training.top_k must be >= 1"),
    "zero layernorm eps": ("model: {layernorm_eps: 0}\n", "model.layernorm_eps must be > 0"),
    "validation every window": ("data: {valid_every: 1}\n", "data.valid_every must be >= 2"),
}

CASES = {**FLAGS, **DATA, **TOKENIZERS, **CHECKPOINTS, **OUTPUTS,
         **{f"yaml: {name}": (["--config", f"{{d}}/yaml/{i}.yaml"], expected)
            for i, (name, (_, expected)) in enumerate(YAML.items())}}


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """A folder of everything the catalogue refers to as {d}."""
    root = tmp_path_factory.mktemp("catalogue")
    (root / "small.txt").write_text("hello world\n" * 100)  # 1200 bytes
    (root / "sft_long.jsonl").write_text("".join(
        json.dumps({"prompt": f"question {i}: " + "why " * 50, "completion": " because."}) + "\n" for i in range(200)))
    (root / "empty.txt").write_text("")
    (root / "blob.dat").write_bytes(b"\xff\xfe\xfd" * 100)
    (root / "emptydir").mkdir()
    (root / "binaries").mkdir()
    (root / "binaries" / "blob.dat").write_bytes(b"\xff\xfe\xfd" * 100)
    prepare(root / "small.txt", root / "tokens")
    (root / "headless.bin").write_bytes((root / "tokens.bin").read_bytes())
    for name, top in (("wide", None), ("wide-header", 400)):  # an id past the byte vocabulary
        prepare(root / "small.txt", root / name)
        ids = np.fromfile(root / f"{name}.bin", dtype="<u2")
        ids[5] = 300
        ids.tofile(root / f"{name}.bin")
        header = json.loads((root / f"{name}.json").read_text())
        assert header.pop("max_id") < 257  # recorded by prepare
        if top is not None:
            header["max_id"] = top
        (root / f"{name}.json").write_text(json.dumps(header))
    prepare(root / "small.txt", root / "truncated")
    (root / "truncated.bin").write_bytes((root / "truncated.bin").read_bytes()[:-2])
    (root / "notatokenizer.json").write_text("{}")
    _hf_tokenizer(root / "hf300.json")
    for name, latest in (("latest-missing", "step_0000005\n"), ("latest-empty", "")):
        (root / name).mkdir()
        (root / name / "latest").write_text(latest)
    cfg = preset_config("tiny")
    checkpoint.save_checkpoint(root / "ckpt", 1, Decoder(cfg.model), None, cfg)
    shutil.copytree(root / "ckpt", root / "ckpt-damaged")
    (checkpoint.step_dir(root / "ckpt-damaged", 1) / "__0_0.distcp").unlink()
    (root / "yaml").mkdir()
    for i, (text, _) in enumerate(YAML.values()):
        (root / "yaml" / f"{i}.yaml").write_text(text)
    return root


def _hf_tokenizer(path: Path) -> None:
    """A word-level tokenizer of exactly 300 tokens: more than the byte vocabulary's 257."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(298)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def _refused_in_process(argv: list[str], expected: str, capsys) -> None:
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gridtrain: error: "), err
    assert "Traceback" not in err and expected in err, err


@pytest.mark.parametrize("world", ["one process", "nproc 2"])
@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_process(case, world, d, capsys, no_process_may_start):
    argv, expected = CASES[case]
    argv = [a.replace("{d}", str(d)) for a in argv] + (["--nproc", "2"] if world == "nproc 2" else [])
    _refused_in_process(argv, expected.replace("{d}", str(d)), capsys)


@pytest.mark.parametrize("case", list(FIXED_WORLD))
def test_refused_world_before_any_process(case, d, capsys, no_process_may_start):
    argv, expected = FIXED_WORLD[case]
    _refused_in_process([a.replace("{d}", str(d)) for a in argv], expected, capsys)


def test_the_catalogue_is_large_enough():
    assert len(CASES) + len(FIXED_WORLD) >= 60


def test_a_world_beyond_memory_is_refused(capsys, monkeypatch, no_process_may_start):
    monkeypatch.setattr(validate_config, "available_memory", lambda: 1 << 30)
    _refused_in_process(["--nproc", "8"], "1.0 GiB available", capsys)
    _refused_in_process(["--nproc", "8"], "lower --nproc to at most 4, or launch across hosts with torchrun", capsys)


def test_an_unwritable_location_is_refused(tmp_path, monkeypatch):
    """What a non-root user sees for a directory they may not write (root may write anywhere)."""
    monkeypatch.setattr(validate_config.os, "access", lambda path, mode: not mode & os.W_OK)
    cfg = load_config(None, {"training": {"save": str(tmp_path / "run")}})
    with pytest.raises(ConfigError, match=f"cannot be created, {tmp_path} is not writable"):
        validate(cfg, world_size=1)
    assert not (tmp_path / "run").exists()


def _processes_tagged(tag: str) -> list[int]:
    """Processes whose environment holds ``tag`` (children inherit it), without psutil."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


SHELL_CASES = [
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--data", "{d}/small.txt"], "needed for one validation window"),
    (["--load", "{d}/nothing"], "does not exist"),
    (["--save", "{d}/small.txt"], "exists and is not a directory"),
]


@pytest.mark.spawn
def test_refused_in_a_real_shell_without_traceback_or_workers(d):
    """Real launchers (run side by side to keep the test short): one line, exit 2, and no
    process of theirs remains."""
    tag = f"GRIDTRAIN_CATALOGUE={uuid.uuid4().hex}"
    env = {**os.environ, "GRIDTRAIN_CATALOGUE": tag.split("=", 1)[1], "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "gridtrain", "train", "--nproc", "2",
                               *[a.replace("{d}", str(d)) for a in argv]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for argv, _ in SHELL_CASES]
    for proc, (_, expected) in zip(procs, SHELL_CASES):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert err.count("\n") == 1 and err.startswith("gridtrain: error: ") and expected in err, err
        assert "Traceback" not in out + err
    deadline = time.monotonic() + 5
    while _processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_tagged(tag) == []


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")))
def test_example_configs_validate(path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert validate(load_config(path)) is not None


def test_yaml_numbers_as_strings_and_ints_are_floats(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  lr: 1e-3\n  weight_decay: 0\n  dist_timeout_s: '30'\n")
    cfg = validate(load_config(str(path)), world_size=1)
    o, t = cfg.optim, cfg.training
    assert (o.lr, o.weight_decay, t.dist_timeout_s) == (0.001, 0.0, 30.0)
    assert all(isinstance(x, float) for x in (o.lr, o.weight_decay, t.dist_timeout_s))


def test_python_api_configs_are_checked_and_normalised():
    cfg = preset_config("tiny")
    cfg.optim.lr = 1  # an int where a float is wanted: fine, and made a float
    assert validate(cfg, world_size=1).optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    cfg.training.steps = 2.5
    with pytest.raises(ConfigError, match="training.steps must be an integer, got 2.5"):
        validate(cfg, world_size=1)


def test_a_custom_datasets_provider_skips_the_corpus_checks():
    cfg = preset_config("tiny")
    cfg.model.vocab_size = 10  # the user's own data has 10 token ids; the byte tokenizer is not used
    with pytest.raises(ConfigError, match="pass --vocab-size 257"):
        validate(cfg, world_size=1)
    assert validate(cfg, world_size=1, data=False) is cfg


def test_validate_is_idempotent_fast_and_works_inside_a_worker(monkeypatch):
    cfg = preset_config("tiny")
    cfg.parallel.nproc = 2
    before = dataclasses.asdict(validate(cfg))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    start = time.perf_counter()
    assert dataclasses.asdict(validate(cfg)) == before
    assert time.perf_counter() - start < 0.5
    one_rank = Config()  # a benchmark's one-rank reference inside a larger world
    assert validate(one_rank, world_size=1) is one_rank


def test_fields_are_named_by_their_flags():
    """validate_config's names agree with the `gridtrain train` parser: a field with a flag
    is named by it, a field without one by section.key."""
    train = cli.build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {s for action in train._actions for s in action.option_strings}
    for section in ("model", "parallel", "training", "data"):
        for f in dataclasses.fields(getattr(Config(), section)):
            name = field_name(section, f.name)
            if name.startswith("--"):
                assert name in flags, (section, f.name, name)
            else:
                assert "--" + f.name.replace("_", "-") not in flags, f"{name} has a flag now: update WITHOUT_FLAG"


def test_prepared_files_follow_the_umask(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello\n" * 10)
    old = os.umask(0o022)
    try:
        bin_path = prepare(text, tmp_path / "tok")
    finally:
        os.umask(old)
    assert (bin_path.stat().st_mode & 0o777) == 0o644
    assert ((tmp_path / "tok.json").stat().st_mode & 0o777) == 0o644
