"""Sharded checkpoints as data: where each rank's pieces lie in the global tensors, what
the files hold (every element once), and how much host memory a save and a load take.

The box arithmetic is checked against tensor_parallel.shard (the function that cuts
every rank's shard at init), so a checkpoint describes exactly what each rank holds.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gridtrain import checkpoint
from gridtrain.checkpoint.shards import Placement, Slab, flat_boxes
from gridtrain.config import preset_config, set_fields
from gridtrain.parallel.distributed import shutdown
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider
from gridtrain.parallel.tensor_parallel import ShardSpec, shard
from gridtrain.training.trainer import build


def _box_of(tensor_shape, box):
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 3, 2, 3)])
def test_flat_boxes_partition_a_range_into_contiguous_boxes(shape):
    rng = random.Random(0)
    total = math.prod(shape)
    flat = torch.arange(total).reshape(shape)
    for _ in range(60):
        lo = rng.randrange(total)
        hi = rng.randrange(lo, total) + 1
        boxes = flat_boxes(shape, lo, hi)
        covered = torch.cat([flat[_box_of(shape, b)].reshape(-1) for b in boxes])
        assert covered.tolist() == list(range(lo, hi))  # in order, each element once
        for b in boxes:  # each box is one contiguous run starting at b.start
            assert flat[_box_of(shape, b)].reshape(-1).tolist() == list(range(b.start, b.start + b.numel))
        assert len(boxes) <= 2 * len(shape) - 1


CASES = [  # (global shape, spec, tp, real rows)
    ((12, 6), None, 1, None),
    ((12, 6), ShardSpec(0), 2, None),
    ((6, 12), ShardSpec(1), 4, None),
    ((12, 6), ShardSpec(0, parts=3), 2, None),  # GPT-2's fused QKV
    ((4, 6), ShardSpec(0, replicas=2), 4, None),  # Llama's kv heads replicated over tp 4
    ((16, 4), ShardSpec(0), 4, 9),  # a padded vocabulary: rows 9.. are padding
    ((16, 4), None, 1, 13),
]


@pytest.mark.parametrize("global_shape,spec,tp,rows", CASES)
def test_each_rank_pieces_are_its_shard_at_the_right_place(global_shape, spec, tp, rows):
    full = torch.randn(global_shape)
    real = full[:rows] if rows is not None else full
    seen = torch.zeros(real.shape, dtype=torch.long)
    for rank in range(tp):
        local = shard(full, spec, rank, tp) if spec is not None else full
        where = Placement.of(tuple(local.shape), spec, rank, tp, rows)
        assert where.global_shape == tuple(real.shape)
        for offsets, view in Slab.of(local, where).pieces.items():
            index = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
            assert torch.equal(view, real[index])
            seen[index] += 1
        # a ZeRO-like split of the flattened shard: the same elements, cut differently
        flat = local.reshape(-1)
        cut = flat.numel() // 3
        for lo, hi in ((0, cut), (cut, flat.numel())):
            for offsets, view in Slab.of_flat(flat[lo:hi], lo, tuple(local.shape), where).pieces.items():
                index = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                assert torch.equal(view, real[index])
    copies = spec.replicas if spec is not None else tp
    assert torch.equal(seen, torch.full_like(seen, copies))  # every element held, replicas alike


# ---- what the files hold ------------------------------------------------------------------------


def stored_bytes_by_file(step) -> tuple[dict[str, int], dict[str, int]]:
    """Payload bytes per rank's file, and per key prefix (model/optim), from DCP's index;
    checks that each tensor's chunks tile it exactly (every element stored once)."""
    md = dcp.FileSystemReader(step).read_metadata()
    per_file: dict[str, int] = {}
    per_kind: dict[str, int] = {}
    for key, tensor in md.state_dict_metadata.items():
        if not hasattr(tensor, "chunks"):
            continue
        cover = torch.zeros(tuple(tensor.size), dtype=torch.int8)
        for index, chunk in enumerate(tensor.chunks):
            cover[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] += 1
        assert bool((cover == 1).all()), f"{key}: elements stored {cover.min()}..{cover.max()} times"
        item = tensor.properties.dtype.itemsize
        kind = key.split("/")[0]
        per_kind[kind] = per_kind.get(kind, 0) + cover.numel() * item
    for index, info in md.storage_data.items():
        if not hasattr(md.state_dict_metadata[index.fqn], "chunks"):
            continue  # RNG states (bytes)
        chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if tuple(c.offsets) == tuple(index.offset))
        item = md.state_dict_metadata[index.fqn].properties.dtype.itemsize
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + math.prod(chunk.sizes) * item
    return per_file, per_kind


# ---- host memory of a save and a load -----------------------------------------------------------


def _peak_rss_reset() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.mark.slow
def test_save_and_load_need_little_more_host_memory_than_the_state(tmp_path):
    """A bf16 model with flat fp32 optimizer state (about 310 MiB written): a save needs at
    most the largest tensor plus a small constant on top of the rank's own state (one
    piece cloned at a time: dcp_io.Writer); a load twice the largest tensor (the chunk's
    bytes and the tensor torch.load makes of them) plus the constant. Measured as the
    peak resident set of this process (VmHWM, reset before each), at the second save and
    load: the first of each also loads code and grows the allocator's free pools by a
    few tens of MiB that a fresh process has not got yet (a meta-device build leaves
    none behind), which is start-up, not the save's cost. A writer that kept a second
    copy of the state (torch's own, for views) would need ~290 MiB more at every save."""
    cfg = preset_config("tiny")
    cfg.model = dataclasses.replace(cfg.model, n_layer=6, d_model=512, n_head=8, vocab_size=8192)
    set_fields(cfg, dtype="bf16", steps=1, global_batch_size=2, micro_batch_size=2, progress=False,
               save=str(tmp_path / "run"))
    try:
        trainer = build(cfg, decoder_model_provider, decoder_forward_step, text_datasets_provider)
        largest = max(p.numel() for p in trainer.model.parameters()) * 4  # in fp32 (the masters)
        state = sum(p.numel() for p in trainer.model.parameters()) * (2 + 3 * 4)
        trainer.save(1)  # the first save also imports DCP's planners and sizes the allocator's pools
        before = _peak_rss_reset()
        trainer.save(2)
        save_extra = _status("VmHWM") - before
        step = checkpoint.step_dir(tmp_path / "run", 1)
        per_file, per_kind = stored_bytes_by_file(step)
        assert sum(per_kind.values()) == state  # bf16 weights, fp32 masters and two moments, once
        checkpoint.load_checkpoint(step, trainer.model, trainer.optimizer, trainer.ctx)  # hashed first
        before = _peak_rss_reset()
        checkpoint.load_checkpoint(step, trainer.model, trainer.optimizer, trainer.ctx)
        load_extra = _status("VmHWM") - before
    finally:
        shutdown()
    constant = 24 << 20
    print(f"state {state / 2**20:.0f} MiB, largest tensor {largest / 2**20:.1f} MiB; peak above the state: "
          f"save {save_extra / 2**20:.1f} MiB, load {load_extra / 2**20:.1f} MiB")
    assert save_extra <= largest + constant, f"save needed {save_extra / 2**20:.1f} MiB more"
    assert load_extra <= 2 * largest + constant, f"load needed {load_extra / 2**20:.1f} MiB more"


def test_a_whole_model_reads_one_tensor_at_a_time(tmp_path):
    """The one-process readers (export, generate, load_model) see every weight by name with
    its shape from the index, and read exactly the saved values."""
    cfg = preset_config("tiny")
    model = Decoder(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    checkpoint.save_checkpoint(tmp_path, 3, model, None, cfg)
    tensors = checkpoint.weight_tensors(checkpoint.step_dir(tmp_path, 3))
    expected = {n: p for n, p in model.named_parameters()}
    assert sorted(tensors.names()) == sorted(expected)
    for name in tensors.names():
        rows = cfg.model.vocab_size if name == "embedding.word.weight" else expected[name].shape[0]
        assert tensors.spec(name) == (torch.float32, (rows, *expected[name].shape[1:]))
        assert torch.equal(tensors.get(name), expected[name][:rows])


# ---- the background writer, and checkpoint info ----------------------------------------------------


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path, monkeypatch):
    """--save-async: the training thread learns of a failed write at the next save (or
    the end of the run), as one line naming the step; nothing is silent."""
    from gridtrain.checkpoint import background

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(background, "write_state", fail)
    saver = background.BackgroundSaver()
    piece = torch.ones(4)
    report = saver.save(tmp_path, 7, {"model/w": Slab.of(piece, Placement.of((4,), None, 0, 1))}, {"step": 7})
    piece.zero_()  # the step goes on changing the weights: the write uses the staged copy
    with pytest.raises(checkpoint.CheckpointError, match="background save of step 7 failed.*No space left"):
        saver.wait()
    saver.wait()  # reported once
    assert report.blocked_s >= 0 and report.write_s >= 0


def test_background_write_uses_the_state_as_it_was_when_staged(tmp_path):
    cfg = preset_config("tiny")
    model = Decoder(cfg.model)
    init_parameters(model, 0)
    from gridtrain.checkpoint import background

    saver = background.BackgroundSaver()
    saver.save(tmp_path, 1, checkpoint.state_to_save(model, None, None), checkpoint.meta_of(1, cfg, None, None, None))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next steps, while the write runs
    saver.wait()
    tensors = checkpoint.weight_tensors(checkpoint.step_dir(tmp_path, 1))
    for name in tensors.names():
        assert torch.equal(tensors.get(name), expected[name][: tensors.spec(name)[1][0]])


def test_checkpoint_info_describes_a_checkpoint_and_refuses_a_damaged_one(tmp_path, capsys):
    from gridtrain.cli import parser as cli

    cfg = preset_config("tiny")
    model = Decoder(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    checkpoint.save_checkpoint(tmp_path, 3, model, optimizer, cfg)
    assert cli.main(["checkpoint", "info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in model.parameters())
    assert "step 3, format 2" in out and "integrity: ok" in out and "optimizer step 1" in out
    assert cli.main(["checkpoint", "info", "--json", str(tmp_path)]) == 0
    info = __import__("json").loads(capsys.readouterr().out)
    real = n - (Decoder(cfg.model).embedding.word.weight.shape[0] - cfg.model.vocab_size) * cfg.model.d_model
    assert info["parameters"] == real
    assert info["bytes"]["weights"] == 4 * real and info["bytes"]["optimizer"] == 8 * real
    assert info["layout"]["world_size"] == 1 and info["step"] == 3
    rank_file = checkpoint.step_dir(tmp_path, 3) / "__0_0.distcp"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    assert cli.main(["checkpoint", "info", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "__0_0.distcp has sha256" in err


def _module_level_imports(tree):
    """The modules a file imports when it is imported (not inside a function, a class or
    an ``if TYPE_CHECKING:`` block)."""
    stack, found = list(tree.body), []
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def test_dcp_is_imported_only_by_what_writes_or_reads_a_checkpoint():
    """Importing torch.distributed.checkpoint costs about 1 s per process: no module of the
    package imports it (or dcp_io.py, which does) at import, so a worker that never saves
    or loads does not pay for it."""
    root = Path(checkpoint.__file__).parent.parent
    offenders = [f"{path.relative_to(root)} imports {name}"
                 for path in sorted(root.rglob("*.py")) if path.name != "dcp_io.py"
                 for name in _module_level_imports(ast.parse(path.read_text()))
                 if name.startswith(("torch.distributed.checkpoint", "gridtrain.checkpoint.dcp_io"))]
    assert offenders == []
