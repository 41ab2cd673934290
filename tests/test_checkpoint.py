"""Checkpoint integrity: the manifest, damaged and mismatched checkpoints refused in one
line, re-saves that never lose the complete old copy, and finding the latest checkpoint.

Saves are in the sharded format (torch.distributed.checkpoint: DCP's ``.metadata`` index
and one ``__<rank>_0.distcp`` file per rank); the whole-tensor format of earlier versions
(``model-pp000.safetensors``, ``trainer-pp000.pt``) is built by hand and must still load.
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
from safetensors.torch import save_file

from gridtrain import checkpoint
from gridtrain.cli import parser as cli
from gridtrain.checkpoint import CheckpointError, check_loadable, latest_step_dir, load_checkpoint, sharded
from gridtrain.config import preset_config
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.parallel.tensor_parallel import TensorParallel
from tests.harness import run_on_ranks
from tests.training import tiny_config, train_in_process

STEP = 4
SHARDS, INDEX = "__0_0.distcp", checkpoint.DCP_METADATA  # rank 0's chunks; DCP's index of them


def _model_and_optimizer(seed: int = 0):
    cfg = preset_config("tiny")
    cfg.training.seed = seed
    model = Decoder(cfg.model)
    init_parameters(model, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()  # so that there is Adam state to save
    return cfg, model, optimizer


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _adam(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by parameter name (step count and both moments)."""
    return {name: {k: v.clone() for k, v in optimizer.state[p].items()}
            for name, p in model.named_parameters() if p in optimizer.state}


def _assert_same_adam(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name, state in a.items():
        assert sorted(state) == sorted(b[name]) == ["exp_avg", "exp_avg_sq", "step"], name
        for key, value in state.items():
            assert torch.equal(value, b[name][key]), (name, key)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """One good save directory (step 4 of a tiny model), the weights and the Adam state in it."""
    directory = tmp_path_factory.mktemp("original")
    cfg, model, optimizer = _model_and_optimizer()
    checkpoint.save_checkpoint(directory, STEP, model, optimizer, cfg)
    return directory, cfg, _weights(model), _adam(model, optimizer)


@pytest.fixture
def saved(original, tmp_path) -> Path:
    """A private copy of the good save directory, free to damage."""
    directory = tmp_path / "run"
    shutil.copytree(original[0], directory)
    return directory


def _loaded(directory) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Weights and Adam state loaded from ``directory`` into a fresh model and optimizer."""
    cfg = preset_config("tiny")
    model = Decoder(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert load_checkpoint(directory, model, optimizer) == STEP
    return _weights(model), _adam(model, optimizer)


def _loaded_weights(directory) -> dict[str, torch.Tensor]:
    return _loaded(directory)[0]


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
    assert sorted(manifest["files"]) == [INDEX, SHARDS, "meta.json"]
    for name, entry in manifest["files"].items():
        assert entry["size"] == (step / name).stat().st_size
        assert entry["sha256"] == checkpoint.manifest.sha256(step / name)
    meta = json.loads((step / "meta.json").read_text())
    assert (meta["format"], meta["version"], meta["step"]) == ("gridtrain-checkpoint", 2, STEP)
    assert meta["optimizer"]["step"] == 1 and meta["scaler"] is None
    assert (saved / "latest").read_text() == step.name
    assert sorted(p.name for p in saved.iterdir()) == sorted(["latest", step.name])  # no leftovers


def test_good_checkpoint_round_trips_and_extra_files_are_ignored(saved, original):
    for name in ("notes.txt", "__9_0.distcp", "model-pp009.safetensors", "trainer-pp000.pt"):
        (checkpoint.step_dir(saved, STEP) / name).write_bytes(b"not listed, never read")
    assert check_loadable(saved, original[1]) == checkpoint.step_dir(saved, STEP)
    assert check_loadable(checkpoint.step_dir(saved, STEP), original[1].model).name == "step_0000004"
    weights, adam = _loaded(saved)
    for name, value in weights.items():
        assert torch.equal(value, original[2][name]), name
    _assert_same_adam(adam, original[3])
    assert checkpoint.read_meta(saved)["step"] == STEP


@pytest.mark.slow
def test_trained_checkpoint_resumes_through_the_loop(tmp_path):
    """A save from the real loop passes check_loadable and resumes (test_train checks
    that resuming is bit-exact)."""
    cfg = tiny_config(steps=3, warmup_steps=1)
    cfg.checkpoint.save = str(tmp_path)
    train_in_process(cfg)
    assert check_loadable(tmp_path, cfg).name == "step_0000003"
    resumed = tiny_config(steps=4, warmup_steps=1)
    resumed.checkpoint.load = str(tmp_path)
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
    ("truncated-shards", lambda d, s: _truncate(s / SHARDS), [SHARDS, "bytes, the manifest says", "truncated"]),
    ("flipped-tensor-data", lambda d, s: _flip(s / SHARDS, (s / SHARDS).stat().st_size // 2), [SHARDS, "sha256"]),
    ("flipped-shards-start", lambda d, s: _flip(s / SHARDS, 18), [SHARDS, "sha256"]),
    ("grown-shards", lambda d, s: (s / SHARDS).write_bytes((s / SHARDS).read_bytes() + b"\0"),
     [SHARDS, "longer than written"]),
    ("truncated-index", lambda d, s: _truncate(s / INDEX), [INDEX, "truncated"]),
    ("flipped-index", lambda d, s: _flip(s / INDEX, (s / INDEX).stat().st_size // 2), [INDEX, "sha256"]),
    ("broken-meta", lambda d, s: (s / "meta.json").write_text("{not json"), ["meta.json"]),
    ("flipped-meta", lambda d, s: _flip(s / "meta.json", 5), ["meta.json", "sha256"]),
    ("missing-manifest", lambda d, s: (s / "manifest.json").unlink(), ["no manifest.json", "write_manifest"]),
    ("broken-manifest", lambda d, s: (s / "manifest.json").write_text("{"), ["manifest.json cannot be read"]),
    ("foreign-manifest", lambda d, s: (s / "manifest.json").write_text("[1, 2]"), ["not a gridtrain"]),
    ("manifest-lists-a-missing-file",
     lambda d, s: _edit_manifest(s, lambda m: m["files"].update({"__1_0.distcp": {"size": 1, "sha256": "0"}})),
     ["__1_0.distcp is missing"]),
    ("manifest-without-index", lambda d, s: _edit_manifest(s, lambda m: m["files"].pop(INDEX)),
     ["lists no meta.json, or neither .metadata"]),
    ("missing-shards", lambda d, s: (s / SHARDS).unlink(), [SHARDS, "is missing"]),
    ("missing-index", lambda d, s: (s / INDEX).unlink(), [INDEX, "is missing"]),
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
    ("garbage-shards", SHARDS, lambda p: p.write_bytes(b"garbage")),
    ("truncated-shards", SHARDS, lambda p: _truncate(p, 50)),
    ("truncated-index", INDEX, lambda p: _truncate(p, 50)),
    ("garbage-index", INDEX, lambda p: p.write_bytes(b"garbage")),
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


def _whole_tensor_checkpoint(directory: Path) -> Path:
    """A step directory in the whole-tensor format of earlier versions (format 1), made by
    hand: each weight whole by name without vocabulary padding, Adam's state by name."""
    cfg, model, optimizer = _model_and_optimizer()
    step = checkpoint.step_dir(directory, STEP)
    step.mkdir(parents=True)
    save_file({name: p.detach()[: getattr(p, "vocab_rows", p.shape[0])].contiguous()
               for name, p in model.named_parameters()}, step / "model-pp000.safetensors")
    torch.save({"state": {name: {k: state[k] for k in ("step", "exp_avg", "exp_avg_sq")}
                          for name, state in _adam(model, optimizer).items()},
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                "rng": None, "scaler": None}, step / "trainer-pp000.pt")
    (step / "meta.json").write_text(json.dumps({"step": STEP, "config": cfg.to_dict()}))
    checkpoint.write_manifest(step)
    (directory / "latest").write_text(step.name)
    return step


def test_whole_tensor_checkpoint_of_earlier_versions_still_loads(tmp_path, original):
    step = _whole_tensor_checkpoint(tmp_path)
    assert not checkpoint.is_sharded(step) and check_loadable(tmp_path, original[1]) == step
    weights, adam = _loaded(tmp_path)
    for name, value in weights.items():
        assert torch.equal(value, original[2][name]), name
    _assert_same_adam(adam, original[3])
    (step / "trainer-pp000.pt").write_bytes(b"garbage")  # its files' damage is one line too
    checkpoint.write_manifest(step)
    with pytest.raises(CheckpointError) as exc:
        _loaded(tmp_path)
    assert "trainer-pp000.pt cannot be read" in _one_line(exc)


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
    model = Decoder(cfg.model)
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


def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


# where a save fails: inside DCP's writing (every file is synced), sealing a rank's file,
# rank 0 writing the manifest
BREAK = {"fsync": (os, "fsync"), "_seal": (sharded, "seal"), "_write_manifest": (sharded, "write_manifest_entries")}


@pytest.mark.parametrize("broken", list(BREAK))
def test_failed_resave_keeps_the_complete_old_checkpoint(saved, original, monkeypatch, broken):
    cfg, model, optimizer = _model_and_optimizer(seed=7)
    monkeypatch.setattr(*BREAK[broken], _no_space)
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
    monkeypatch.setattr(os, "replace", replace)
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
    (stale / SHARDS).write_bytes(b"half")
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
    _truncate(checkpoint.step_dir(saved, STEP) / SHARDS)
    with pytest.raises(CheckpointError, match="truncated") as exc:
        latest_step_dir(saved)
    assert _one_line(exc).startswith("--save ")
    (saved / "latest").write_text("")
    with pytest.raises(CheckpointError, match="latest is empty"):
        latest_step_dir(saved)


def test_verification_hashes_a_file_once_per_process(saved, monkeypatch):
    check_loadable(saved)
    hashed = []
    monkeypatch.setattr(checkpoint.manifest, "sha256", lambda p: hashed.append(p.name) or "x")
    check_loadable(saved)
    _loaded_weights(saved)
    assert hashed == []
    time.sleep(0.05)  # past the file system's timestamp granularity
    _flip(checkpoint.step_dir(saved, STEP) / SHARDS, 100)  # a changed file is hashed again
    with pytest.raises(CheckpointError, match="sha256"):
        check_loadable(saved)
    assert hashed == [SHARDS]


# ---- two ranks -------------------------------------------------------------------------------


def _two_rank_save(rank: int, world_size: int, root: str) -> dict:
    """Two ranks holding the same model save it (DCP writes each tensor once, each rank
    its own file), then the same save fails on one rank: inside DCP's writing, sealing
    rank 1's file, rank 0 writing the manifest. Returns the manifest's files and each
    failure's message, as this rank saw them, and the state saved."""
    cfg, model, optimizer = _model_and_optimizer()
    ctx = SimpleNamespace(coords=SimpleNamespace(pp=0, dp=rank, tp=0), tp=TensorParallel(),
                          grid=SimpleNamespace(dp=world_size, tp=1, pp=1), device=torch.device("cpu"))
    checkpoint.save_checkpoint(f"{root}/ok", STEP, model, optimizer, cfg, ctx)
    out = {"ok": sorted(json.loads((checkpoint.step_dir(f"{root}/ok", STEP) / "manifest.json").read_text())["files"]),
           "state": (_weights(model), _adam(model, optimizer))}
    for broken, fail_rank in (("fsync", 1), ("_seal", 1), ("_write_manifest", 0)):
        module, name = BREAK[broken]
        real = getattr(module, name)
        if rank == fail_rank:
            setattr(module, name, _no_space)
        try:
            checkpoint.save_checkpoint(f"{root}/{broken}", STEP, model, optimizer, cfg, ctx)
        except CheckpointError as exc:
            out[broken] = str(exc)
        finally:
            setattr(module, name, real)
    return out


@pytest.mark.spawn
def test_two_ranks_write_one_manifest_and_a_failure_reaches_both(tmp_path):
    ranks = run_on_ranks(_two_rank_save, 2, str(tmp_path))
    assert [r["ok"] for r in ranks] == [[INDEX, SHARDS, "__1_0.distcp", "meta.json"]] * 2
    weights, adam = _loaded(tmp_path / "ok")  # both ranks' files: the model once
    assert all(torch.equal(value, ranks[0]["state"][0][name]) for name, value in weights.items())
    _assert_same_adam(adam, ranks[0]["state"][1])
    for broken, fail_rank in (("fsync", 1), ("_seal", 1), ("_write_manifest", 0)):
        errors = [r.get(broken) for r in ranks]
        assert all(e and f"rank {fail_rank} could not write the checkpoint" in e and "No space left" in e
                   and "\n" not in e for e in errors), (broken, errors)
        assert not any((tmp_path / broken).glob("*step*")) and not any((tmp_path / broken).glob(".step*")), broken
