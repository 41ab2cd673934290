"""Each config field is declared once (gridtrain/config.py): the `train` parser, the range
checks and the flag table of docs/cli.md are read from the declarations, and every flag scripts
used before the declarations existed still parses to the same field."""

from __future__ import annotations

import pytest

from gridtrain.cli import parser as cli
from gridtrain.cli.flag_table import BEGIN, END, CLI_DOC, flag_table, with_table
from gridtrain.config import ConfigError, declared_fields, flag_of, load_config

# every `train` flag with a value, and the field it set, before the fields were declared once
OLD_FLAGS = {
    "--nproc": "nproc", "--dp": "dp", "--tp": "tp", "--pp": "pp", "--vpp": "vpp", "--schedule": "schedule",
    "--pp-layers": "pp_layers", "--pp-partition": "pp_partition", "--bucket-mb": "bucket_mb", "--arch": "arch",
    "--n-layer": "n_layer", "--n-head": "n_head", "--n-kv-head": "n_kv_head", "--d-model": "d_model",
    "--ffn-hidden": "ffn_hidden", "--rope-theta": "rope_theta", "--seq-len": "seq_len", "--vocab-size": "vocab_size",
    "--dropout": "dropout", "--attention": "attention", "--micro-batch-size": "micro_batch_size",
    "--global-batch-size": "global_batch_size", "--recompute": "recompute", "--recompute-method": "recompute_method",
    "--recompute-layers": "recompute_layers", "--dtype": "dtype", "--zero": "zero", "--loss-scale": "loss_scale",
    "--min-loss-scale": "min_loss_scale", "--steps": "steps", "--lr": "lr", "--warmup-steps": "warmup_steps",
    "--weight-decay": "weight_decay", "--grad-clip": "grad_clip", "--seed": "seed", "--device": "device",
    "--eval-interval": "eval_interval", "--eval-iters": "eval_iters", "--metrics-file": "metrics_file",
    "--save": "save", "--save-interval": "save_interval", "--keep-last": "keep_last", "--load": "load",
    "--init-from": "init_from", "--sample-tokens": "sample_tokens", "--prompt": "prompt",
    "--peak-tflops": "peak_tflops", "--timeout": "dist_timeout_s", "--trace": "trace",
    "--tensorboard": "tensorboard", "--data": "path", "--tokenizer": "tokenizer",
}
OLD_SWITCHES = {"--sequence-parallel": ("sequence_parallel", True), "--no-progress": ("progress", False),
                "--recompute-keep-last": ("recompute_keep_last", True), "--recompute-early": ("recompute_early", True),
                "--offload-activations": ("offload_activations", True), "--memory-report": ("memory_report", True),
                "--save-async": ("save_async", True), "--compile": ("compile", True),
                "--auto-resume": ("auto_resume", True)}


def test_cli_doc_flag_table_is_the_generated_one():
    """Run ``python -m gridtrain.cli.flag_table`` after changing a declaration."""
    text = CLI_DOC.read_text()
    assert BEGIN in text and END in text
    assert with_table(text) == text, "docs/cli.md's flag table is stale: python -m gridtrain.cli.flag_table"


def test_every_flag_of_the_parser_has_a_row_and_every_row_a_flag():
    table = flag_table()
    for section, f in declared_fields():
        assert f"`{section}.{f.name}`" in table
        flag = flag_of(f)
        assert flag is None or f"| `{flag}" in table


def _field(cfg, name):
    return next(getattr(getattr(cfg, s), name) for s, f in declared_fields() if f.name == name)


@pytest.mark.parametrize("flag", sorted(set(OLD_FLAGS) - {"--init-from"}))  # reads its source: test_hf
def test_old_value_flags_still_set_their_field(flag):
    name = OLD_FLAGS[flag]
    f = next(f for _, f in declared_fields() if f.name == name)
    value = {"pp_layers": "1,1", "device": "cpu", "arch": "llama", "attention": "math", "dtype": "bf16",
             "recompute": "full", "recompute_method": "block", "schedule": "gpipe", "pp_partition": "time",
             "zero": "1"}.get(name)
    if value is None:
        value = "7" if f.type in ("int", "int | None") else "0.5" if "float" in str(f.type) else "x"
    cfg = cli.config_from_args(cli.build_parser().parse_args(["train", flag, value]))
    expected = {"pp_layers": [1, 1], "zero": 1}.get(name, value)
    got = _field(cfg, name)
    assert str(got) == str(expected) or got == float(value)


@pytest.mark.parametrize("flag", sorted(OLD_SWITCHES))
def test_old_switches_still_set_their_field(flag):
    name, value = OLD_SWITCHES[flag]
    assert _field(cli.config_from_args(cli.build_parser().parse_args(["train", flag])), name) is value


def test_old_config_files_spell_moved_keys_under_training(tmp_path):
    """A file written before the split by topic loads into the new sections, and a range
    error names the key as the file spells it."""
    path = tmp_path / "old.yaml"
    path.write_text("training: {lr: 0.01, zero: 1, recompute: full, save: ckpt, eval_interval: 3, top_k: 5}\n")
    cfg = load_config(str(path))
    assert (cfg.optim.lr, cfg.parallel.zero, cfg.activations.recompute) == (0.01, 1, "full")
    assert (cfg.checkpoint.save, cfg.eval.eval_interval, cfg.sample.top_k) == ("ckpt", 3, 5)
    path.write_text("training: {beta2: 1.0}\n")
    with pytest.raises(ConfigError, match=r"training.beta2 must be in \[0, 1\)"):
        load_config(str(path))


def test_moved_fields_are_not_silently_set_on_training():
    from gridtrain.config import preset_config

    cfg = preset_config("tiny")
    with pytest.raises(AttributeError, match="cfg.optim.lr"):
        cfg.training.lr = 0.5
    with pytest.raises(AttributeError, match="cfg.optim.lr"):
        cfg.training.lr
