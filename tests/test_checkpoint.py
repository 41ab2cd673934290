"""Checkpoint integrity: the manifest, damaged and mismatched checkpoints refused in one
line, re-saves that never lose the complete old copy, and finding the latest checkpoint.

Most tests save a tiny model directly in this process (no training, no process group);
one trains through the real loop, one saves from two real ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gridtrain import checkpoint, cli
from gridtrain.checkpoint import CheckpointError, check_loadable, latest_step_dir, load_checkpoint
from gridtrain.config import preset_config
from gridtrain.model import GPT, init_parameters
from gridtrain.tensor_parallel import TensorParallel
from tests.harness import run_on_ranks
from tests.training import tiny_config, train_in_process

STEP = 4
WEIGHTS, TRAINER = "model-pp000.safetensors", "trainer-pp000.pt"


def _model_and_optimizer(seed: int = 0):
    cfg = preset_config("tiny")
    cfg.training.seed = seed
    model = GPT(cfg.model)
    init_parameters(model, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()  # so that there is Adam state to save
    return cfg, model, optimizer


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """One good save directory (step 4 of a tiny model) and the weights in it."""
    directory = tmp_path_factory.mktemp("original")
    cfg, model, optimizer = _model_and_optimizer()
    checkpoint.save_checkpoint(directory, STEP, model, optimizer, cfg)
    return directory, cfg, _weights(model)


@pytest.fixture
def saved(original, tmp_path) -> Path:
    """A private copy of the good save directory, free to damage."""
    directory = tmp_path / "run"
    shutil.copytree(original[0], directory)
    return directory


def _loaded_weights(directory) -> dict[str, torch.Tensor]:
    cfg = preset_config("tiny")
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert load_checkpoint(directory, model, optimizer) == STEP
    return _weights(model)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# ---- a good checkpoint ----------------------------------------------------------------------


def test_manifest_lists_every_file_with_size_and_sha256(saved):
    step = checkpoint.step_dir(saved, STEP)
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["checksum"] == "sha256" and manifest["step"] == STEP
    assert sorted(manifest["files"]) == sorted(p.name for p in step.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == ["meta.json", WEIGHTS, TRAINER]
    for name, entry in manifest["files"].items():
        assert entry["size"] == (step / name).stat().st_size
        assert entry["sha256"] == checkpoint._sha256(step / name)
    assert (saved / "latest").read_text() == step.name
    assert sorted(p.name for p in saved.iterdir()) == sorted(["latest", step.name])  # no leftovers


def test_good_checkpoint_round_trips_and_extra_files_are_ignored(saved, original):
    (checkpoint.step_dir(saved, STEP) / "notes.txt").write_text("mine")
    (checkpoint.step_dir(saved, STEP) / "model-pp009.safetensors").write_bytes(b"not listed, never read")
    assert check_loadable(saved, original[1]) == checkpoint.step_dir(saved, STEP)
    assert check_loadable(checkpoint.step_dir(saved, STEP), original[1].model).name == "step_0000004"
    for name, value in _loaded_weights(saved).items():
        assert torch.equal(value, original[2][name]), name
    assert checkpoint.read_meta(saved)["step"] == STEP


def test_trained_checkpoint_resumes_through_the_loop(tmp_path):
    """A save from the real loop passes check_loadable and resumes (test_train checks
    that resuming is bit-exact)."""
    cfg = tiny_config(steps=3, warmup_steps=1)
    cfg.training.save = str(tmp_path)
    train_in_process(cfg)
    assert check_loadable(tmp_path, cfg).name == "step_0000003"
    resumed = tiny_config(steps=4, warmup_steps=1)
    resumed.training.load = str(tmp_path)
    assert len(train_in_process(resumed)["losses"]) == 1


# ---- damaged checkpoints: one line naming the file -------------------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path, by: int = 100) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-by])


def _edit_manifest(step: Path, edit) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    edit(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))


# (id, damage(save_dir, step_dir), words the one line must contain)
DAMAGE = [
    ("truncated-weights", lambda d, s: _truncate(s / WEIGHTS), [WEIGHTS, "bytes, the manifest says", "truncated"]),
    ("flipped-tensor-data", lambda d, s: _flip(s / WEIGHTS, (s / WEIGHTS).stat().st_size - 7),
     [WEIGHTS, "sha256"]),
    ("flipped-weights-header", lambda d, s: _flip(s / WEIGHTS, 18), [WEIGHTS, "sha256"]),
    ("truncated-trainer", lambda d, s: _truncate(s / TRAINER), [TRAINER, "truncated"]),
    ("flipped-trainer", lambda d, s: _flip(s / TRAINER, (s / TRAINER).stat().st_size // 2), [TRAINER, "sha256"]),
    ("broken-meta", lambda d, s: (s / "meta.json").write_text("{not json"), ["meta.json"]),
    ("flipped-meta", lambda d, s: _flip(s / "meta.json", 5), ["meta.json", "sha256"]),
    ("missing-manifest", lambda d, s: (s / "manifest.json").unlink(), ["no manifest.json", "write_manifest"]),
    ("broken-manifest", lambda d, s: (s / "manifest.json").write_text("{"), ["manifest.json cannot be read"]),
    ("foreign-manifest", lambda d, s: (s / "manifest.json").write_text("[1, 2]"), ["not a gridtrain"]),
    ("manifest-lists-a-missing-file",
     lambda d, s: _edit_manifest(s, lambda m: m["files"].update({"model-pp001.safetensors": {"size": 1, "sha256": "0"}})),
     ["model-pp001.safetensors is missing"]),
    ("missing-weights", lambda d, s: (s / WEIGHTS).unlink(), [WEIGHTS, "is missing"]),
    ("missing-trainer", lambda d, s: (s / TRAINER).unlink(), [TRAINER, "is missing"]),
    ("latest-names-a-missing-step", lambda d, s: (d / "latest").write_text("step_0000099"),
     ["latest names 'step_0000099', which does not exist", "step_0000004"]),
    ("empty-latest", lambda d, s: (d / "latest").write_text(""), ["latest is empty", "step_0000004"]),
    ("garbage-latest", lambda d, s: (d / "latest").write_text("../../etc"), ["not a step directory name"]),
    ("binary-latest", lambda d, s: (d / "latest").write_bytes(b"\xff\xfe\x00"), ["latest cannot be read"]),
    ("step-dir-removed", lambda d, s: shutil.rmtree(s), ["latest names 'step_0000004', which does not exist"]),
]


@pytest.mark.parametrize("damage, words", [(d, w) for _, d, w in DAMAGE], ids=[i for i, _, _ in DAMAGE])
def test_damaged_checkpoint_is_refused_in_one_line(saved, original, damage, words, capsys):
    damage(saved, checkpoint.step_dir(saved, STEP))
    with pytest.raises(CheckpointError) as exc:
        check_loadable(saved, original[1])
    message = _one_line(exc)
    for word in words:
        assert word in message, message
    assert message.startswith("--load ")
    with pytest.raises(CheckpointError) as exc:  # the loader checks the same way on its own
        _loaded_weights(saved)
    assert _one_line(exc) == message
    # and `gridtrain generate --load` (read_meta, then load_checkpoint) says it in one line
    assert cli.main(["generate", "--load", str(saved), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and words[0] in err, err


# Damage that the manifest cannot see (it was rewritten over the damaged file, as
# write_manifest would): the readers' own errors still come out as one line.
UNREADABLE = [
    ("broken-weights-header", WEIGHTS, lambda p: p.write_bytes(b"\xff" * 8 + p.read_bytes()[8:])),
    ("truncated-weights", WEIGHTS, lambda p: _truncate(p, 50)),
    ("truncated-trainer", TRAINER, lambda p: _truncate(p, 50)),
    ("garbage-trainer", TRAINER, lambda p: p.write_bytes(b"garbage")),
    ("broken-meta", "meta.json", lambda p: p.write_text("{not json")),
    ("meta-without-step", "meta.json", lambda p: p.write_text('{"config": {}}')),
]


@pytest.mark.parametrize("name, damage", [(n, d) for _, n, d in UNREADABLE], ids=[i for i, _, _ in UNREADABLE])
def test_unreadable_file_behind_a_matching_manifest_is_one_line(saved, name, damage):
    step = checkpoint.step_dir(saved, STEP)
    damage(step / name)
    checkpoint.write_manifest(step)
    with pytest.raises(CheckpointError) as exc:
        _loaded_weights(saved)
    message = _one_line(exc)
    assert name in message and ("cannot be read" in message or "lacks" in message), message


def test_checkpoint_from_before_manifests_is_refused_then_adopted(saved, original):
    step = checkpoint.step_dir(saved, STEP)
    (step / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        checkpoint.read_meta(saved)
    checkpoint.write_manifest(step)  # the fix the message gives
    for name, value in _loaded_weights(saved).items():
        assert torch.equal(value, original[2][name]), name


def test_missing_and_empty_directories_are_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as exc:
        check_loadable(tmp_path / "nope")
    _one_line(exc)
    with pytest.raises(CheckpointError, match="no checkpoint there") as exc:
        check_loadable(tmp_path)
    _one_line(exc)


# ---- the model config is compared on load ----------------------------------------------------


def test_model_config_mismatch_names_every_differing_field(saved, original):
    cfg = preset_config("tiny")
    cfg.model.n_layer, cfg.model.n_head = 1, 2
    with pytest.raises(CheckpointError) as exc:
        check_loadable(saved, cfg)
    message = _one_line(exc)
    assert "n_layer 2 (checkpoint) vs 1 (flags)" in message and "n_head 4 vs 2" in message, message
    assert "--n-layer 2 --n-head 4" in message, message
    # the loader refuses too: a 1-layer model used to load a 2-layer checkpoint silently
    model = GPT(cfg.model)
    with pytest.raises(CheckpointError, match="n_layer 2"):
        load_checkpoint(saved, model)


def test_fields_without_flags_name_the_config_key(saved):
    cfg = preset_config("tiny")
    cfg.model.layernorm_eps, cfg.model.ffn_hidden = 1e-6, 128
    with pytest.raises(CheckpointError) as exc:
        check_loadable(saved, cfg)
    message = _one_line(exc)
    assert "layernorm_eps 1e-05 (checkpoint) vs 1e-06" in message and "ffn_size 256 vs 128" in message
    assert "model.layernorm_eps: 1e-05" in message and "model.ffn_hidden: 256" in message, message


def test_fields_that_keep_the_weights_are_not_compared(saved):
    cfg = preset_config("tiny")
    cfg.model = dataclasses.replace(cfg.model, dropout=0.1, attention="math", vocab_pad_multiple=8,
                                    ffn_hidden=4 * cfg.model.d_model)
    assert check_loadable(saved, cfg).name == "step_0000004"


# ---- re-saving a step -------------------------------------------------------------------------


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("broken", ["save_file", "torch_save", "_write_manifest"])
def test_failed_resave_keeps_the_complete_old_checkpoint(saved, original, monkeypatch, broken):
    cfg, model, optimizer = _model_and_optimizer(seed=7)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    if broken == "torch_save":
        monkeypatch.setattr(checkpoint.torch, "save", fail)
    else:
        monkeypatch.setattr(checkpoint, broken, fail)
    with pytest.raises(CheckpointError) as exc:
        checkpoint.save_checkpoint(saved, STEP, model, optimizer, cfg)
    assert "No space left on device" in _one_line(exc) and "previous checkpoint is unchanged" in str(exc.value)
    monkeypatch.undo()
    assert _hidden(saved) == []  # the incomplete new directory is gone
    for name, value in _loaded_weights(saved).items():
        assert torch.equal(value, original[2][name]), name


def test_crash_between_the_renames_leaves_latest_loadable(saved, original, monkeypatch):
    """Old renamed aside, new not yet in place: `latest` names a missing directory for a
    moment, and resolve finds the complete hidden copy of that step."""
    cfg, model, optimizer = _model_and_optimizer(seed=7)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == f"step_{STEP:07d}":
            raise KeyboardInterrupt  # the process dies here
        real_replace(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(saved, STEP, model, optimizer, cfg)
    monkeypatch.undo()
    assert not checkpoint.step_dir(saved, STEP).exists()
    assert any(".old-" in n for n in _hidden(saved)) and any(".tmp-" in n for n in _hidden(saved))
    found = check_loadable(saved, cfg)
    assert found.name.startswith(".step_0000004.tmp-")  # the newer complete copy
    assert latest_step_dir(saved) == found
    loaded = _loaded_weights(saved)
    assert all(torch.equal(loaded[k], v) for k, v in _weights(model).items())
    # the next save puts everything in order again
    checkpoint.save_checkpoint(saved, STEP + 1, model, optimizer, cfg)
    assert _hidden(saved) == [] and latest_step_dir(saved).name == "step_0000005"


def test_resave_replaces_the_step_and_clears_leftovers(saved, original):
    stale = saved / ".step_0000004.tmp-123-deadbeef"  # a crashed save's leftovers
    stale.mkdir()
    (stale / WEIGHTS).write_bytes(b"half")
    cfg, model, optimizer = _model_and_optimizer(seed=7)
    assert checkpoint.save_checkpoint(saved, STEP, model, optimizer, cfg) == checkpoint.step_dir(saved, STEP)
    assert _hidden(saved) == [] and (saved / "latest").read_text() == "step_0000004"
    loaded = _loaded_weights(saved)
    new = _weights(model)
    assert all(torch.equal(loaded[k], v) for k, v in new.items())
    assert any(not torch.equal(new[k], v) for k, v in original[2].items())


# ---- latest_step_dir (auto-resume) -------------------------------------------------------------


def test_latest_step_dir(saved, tmp_path):
    assert latest_step_dir(tmp_path / "fresh") is None
    (tmp_path / "empty").mkdir()
    assert latest_step_dir(tmp_path / "empty") is None
    assert latest_step_dir(saved) == checkpoint.step_dir(saved, STEP)
    (saved / "latest").unlink()  # saved, but gone before `latest` was written
    assert latest_step_dir(saved) == checkpoint.step_dir(saved, STEP)
    (saved / "latest").write_text("step_0000004")
    _truncate(checkpoint.step_dir(saved, STEP) / WEIGHTS)
    with pytest.raises(CheckpointError, match="truncated") as exc:
        latest_step_dir(saved)
    assert _one_line(exc).startswith("--save ")
    (saved / "latest").write_text("")
    with pytest.raises(CheckpointError, match="latest is empty"):
        latest_step_dir(saved)


def test_verification_hashes_a_file_once_per_process(saved, monkeypatch):
    check_loadable(saved)
    hashed = []
    monkeypatch.setattr(checkpoint, "_sha256", lambda p: hashed.append(p.name) or "x")
    check_loadable(saved)
    _loaded_weights(saved)
    assert hashed == []
    time.sleep(0.05)  # past the file system's timestamp granularity
    _flip(checkpoint.step_dir(saved, STEP) / WEIGHTS, 100)  # a changed file is hashed again
    with pytest.raises(CheckpointError, match="sha256"):
        check_loadable(saved)
    assert hashed == [WEIGHTS]


# ---- two ranks -------------------------------------------------------------------------------


def _two_stage_save(rank: int, world_size: int, directory: str, fail_rank: int | None):
    cfg, model, optimizer = _model_and_optimizer()
    ctx = SimpleNamespace(coords=SimpleNamespace(pp=rank, dp=0, tp=0), tp=TensorParallel(),
                          device=torch.device("cpu"))
    if rank == fail_rank:
        def fail(*args, **kwargs):
            raise OSError(28, "No space left on device")
        checkpoint.save_file = fail
    try:
        checkpoint.save_checkpoint(directory, STEP, model, optimizer, cfg, ctx)
    except CheckpointError as exc:
        return str(exc)
    return sorted(json.loads((checkpoint.step_dir(directory, STEP) / "manifest.json").read_text())["files"])


def test_two_ranks_write_one_manifest_and_a_failure_reaches_both(tmp_path):
    ok, fail = str(tmp_path / "ok"), str(tmp_path / "fail")
    files = ["meta.json", WEIGHTS, "model-pp001.safetensors", TRAINER, "trainer-pp001.pt"]
    assert run_on_ranks(_two_stage_save, 2, ok, None) == [sorted(files)] * 2
    errors = run_on_ranks(_two_stage_save, 2, fail, 1)
    assert all("rank 1 could not write the checkpoint" in e and "\n" not in e for e in errors), errors
    assert not any(Path(fail).glob("*step*")) and not any(Path(fail).glob(".step*"))
