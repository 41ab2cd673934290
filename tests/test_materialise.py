"""Every layout starts from the one-process weights, bit for bit, although each rank
builds its model on the meta device and materialises only what it owns
(gridtrain.checkpoint.materialise): its pipeline chunks, its TP shards, its experts,
under ZeRO-3 only its parameter shard. The reference is the one-process model with
``init_parameters`` (each tensor drawn whole, then copied), an independent path.

One spawn of 8 ranks builds every layout in turn (no training step: only the start).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.start_memory import write_hf_llama
from gridtrain.checkpoint.errors import CheckpointError
from gridtrain.checkpoint.huggingface import apply_init_from, import_hf
from gridtrain.checkpoint.materialise import Stored
from gridtrain.checkpoint.tensor_files import TensorFiles

from gridtrain.config import Config, preset_config, set_fields
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.parallel.distributed import TORCH_DTYPES
from gridtrain.parallel.meta import is_meta, set_storage, stand_in
from gridtrain.parallel.tensor_parallel import shard, shard_spec
from gridtrain.runtime import watchdog
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
from gridtrain.training.trainer import build
from tests.harness import run_on_ranks
from tests.training import fake_tp

pytestmark = pytest.mark.spawn

LLAMA = dict(arch="llama", n_kv_head=2, tie_embeddings=False)
# name -> (preset, fields): 8 ranks each
LAYOUTS = {
    "gpt2 tp2 pp2 dp2 interleaved fp64": ("tiny", dict(n_layer=4, tp=2, pp=2, dp=2, vpp=2,
                                                       schedule="interleaved-1f1b")),
    "llama zero3 tp2 dp4 bf16": ("tiny", dict(LLAMA, zero=3, tp=2, dp=4, dtype="bf16")),
    "llama tp4 (kv heads replicated) dp2 zero1 bf16": ("tiny", dict(LLAMA, tp=4, dp=2, zero=1, dtype="bf16")),
    "gpt2 cp2 tp2 dp2 zero2": ("tiny", dict(cp=2, tp=2, dp=2, zero=2)),
    "moe ep4 dp8 zero3 fp32": ("moe-tiny", dict(dp=8, ep=4, zero=3, dtype="fp32")),
    "moe pp2 ep2 dp4 fp64": ("moe-tiny", dict(pp=2, dp=4, ep=2)),
}


# --init-from a Hugging Face directory (a Llama written by benchmarks/start_memory.py, bf16)
FROM_HF = {
    "hf zero3 tp2 dp4 bf16": dict(zero=3, tp=2, dp=4, dtype="bf16"),
    "hf tp2 pp2 dp2 zero1 fp32": dict(tp=2, pp=2, dp=2, zero=1, dtype="fp32"),
}
HF_SHAPE = dict(n_layer=2, d_model=256, vocab_size=512)


def layout_config(name: str, hf: Path | None = None) -> Config:
    recipe = dict(dtype="fp64", global_batch_size=16, micro_batch_size=1, steps=1, progress=False)
    if name in FROM_HF:
        cfg = set_fields(preset_config("tiny"), **{**recipe, **FROM_HF[name], "init_from": str(hf), "seq_len": 32})
        return apply_init_from(cfg, given={"seq_len"})
    preset, fields = LAYOUTS[name]
    return set_fields(preset_config(preset), **{**recipe, **fields})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_hf_llama(tmp_path_factory.mktemp("hf") / "llama", **HF_SHAPE)


def _initial_weights(rank: int, world_size: int, configs: list[Config]) -> list[dict]:
    out = []
    for cfg in configs:
        trainer = build(cfg, decoder_model_provider, decoder_forward_step)
        if trainer.param_shards is not None:
            trainer.param_shards.gather_all()
        out.append({"tp": (trainer.ctx.tp.rank, trainer.ctx.tp.size),
                    "weights": {n: p.detach().to(torch.float64).cpu() for n, p in trainer.model.named_parameters()},
                    "held": trainer.param_shards.shard.numel() if trainer.param_shards is not None else None})
        watchdog.stop_watchdog()
    return out


@pytest.fixture(scope="module")
def started(hf_dir):
    names = [*LAYOUTS, *FROM_HF]
    per_rank = run_on_ranks(_initial_weights, 8, [layout_config(n, hf_dir) for n in names], timeout_s=300)
    return {name: [runs[i] for runs in per_rank] for i, name in enumerate(names)}


def reference_weights(cfg: Config) -> dict[str, torch.Tensor]:
    """The one-process model's weights in the run's dtype (as fp64 for comparison)."""
    model = Decoder(cfg.model)
    init_parameters(model, cfg.training.seed)
    dtype = TORCH_DTYPES[cfg.training.dtype]
    return {n: p.detach().to(dtype).to(torch.float64) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_rank_starts_from_the_one_process_weights(started, name):
    cfg = layout_config(name)
    assert_ranks_hold(started[name], reference_weights(cfg), cfg)


@pytest.mark.parametrize("name", list(FROM_HF))
def test_init_from_hf_reads_on_each_rank_the_weights_of_a_whole_import(started, name, hf_dir, tmp_path):
    """Each rank reads only its pieces from the safetensors files; what it holds equals
    its pieces of ``import-hf``'s whole tensors (converted one by one, no slices)."""
    import_hf(hf_dir, tmp_path / "imported")
    files = list((tmp_path / "imported").rglob("model-pp*.safetensors"))
    dtype = TORCH_DTYPES[FROM_HF[name]["dtype"]]
    whole = {k: v.to(dtype).to(torch.float64) for f in files for k, v in load_file(f).items()}
    assert_ranks_hold(started[name], whole, layout_config(name, hf_dir))


def assert_ranks_hold(runs: list[dict], reference: dict[str, torch.Tensor], cfg: Config) -> None:
    """Each rank's weights are its pieces of ``reference`` (whole tensors by name)."""
    for rank, run in enumerate(runs):
        tp_rank, tp_size = run["tp"]
        layout = dict(Decoder(dataclasses.replace(cfg.model), tp=fake_tp(tp_size, tp_rank)).named_parameters())
        assert run["weights"], f"rank {rank} holds no parameters"
        for n, value in run["weights"].items():
            whole = "embedding.word.weight" if n == "head" and n not in reference else n  # a tied head copy
            full = reference[whole]
            param = layout[whole]
            spec = shard_spec(param)
            if spec is not None and tp_size > 1:
                padded = full.new_zeros(spec.full_shape(param.shape, tp_size))
                padded[tuple(slice(0, k) for k in full.shape)] = full
                full = shard(padded, spec, tp_rank, tp_size)
            elif hasattr(param, "vocab_rows"):
                padded = full.new_zeros(param.shape)
                padded[: full.shape[0]] = full
                full = padded
            assert value.shape == full.shape, f"rank {rank} {n}"
            assert torch.equal(value, full), f"rank {rank} {n}: differs from the one-process weight"


def test_box_reads_equal_slices_of_the_stored_tensor(tmp_path):
    """TensorFiles.box reads a box with one pread per contiguous run: every box of a
    1-, 2- and 3-D tensor equals the slice of the tensor."""
    tensors = {"a": torch.randn(7, 5, 3).to(torch.bfloat16), "b": torch.randn(11, 6), "c": torch.randn(13)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    files = TensorFiles.of_files([tmp_path / "x.safetensors"])
    rng = random.Random(0)
    for name, x in tensors.items():
        for _ in range(200):
            offsets = tuple(rng.randrange(n) for n in x.shape)
            sizes = tuple(rng.randint(1, n - o) for n, o in zip(x.shape, offsets))
            want = x[tuple(slice(o, o + k) for o, k in zip(offsets, sizes))]
            assert torch.equal(files.box(name, (offsets, sizes)), want), (name, offsets, sizes)


def test_zero3_ranks_hold_only_their_shard(started):
    """Under ZeRO-3 the shard a rank keeps is 1/dp of its stage (plus padding)."""
    for name in ("llama zero3 tp2 dp4 bf16", "moe ep4 dp8 zero3 fp32"):
        cfg = layout_config(name)
        for run in started[name]:
            local = sum(v.numel() for v in run["weights"].values())
            assert run["held"] < local / cfg.parallel.dp * 1.5 + 4096, name


def test_set_storage_keeps_the_parameter_and_its_attributes():
    with torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(3, 2))
    p.tp_spec = "kept"
    assert is_meta(torch.nn.ParameterList([p]))
    ref = p
    set_storage(p, torch.ones(3, 2))
    assert p is ref and p.device.type == "cpu" and p.tp_spec == "kept" and p.requires_grad
    assert torch.equal(p.detach(), torch.ones(3, 2))


def test_a_zero3_stand_in_holds_no_memory_but_takes_hooks():
    with torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(1000, 1000))
    stand_in(p, device="cpu", dtype=torch.bfloat16)
    assert p.shape == (1000, 1000) and p.untyped_storage().nbytes() == 2
    fired = []
    p.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad.shape))
    p.data = torch.ones(1000, 1000, dtype=torch.bfloat16)
    (p * 2).sum().backward()
    assert fired == [(1000, 1000)]


def test_a_source_without_a_weight_or_of_another_shape_is_one_line():
    """Stored's own checks (behind the pre-start ones): a missing tensor, or one that does
    not fit the model, is a CheckpointError naming it, before anything is copied."""
    with torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(4, 3))
    box = ((0, 0), (4, 3))
    with pytest.raises(CheckpointError, match="no weights for w"):
        Stored({}, "--init-from X").read("w", p, (4, 3), box)
    with pytest.raises(CheckpointError, match=r"w has shape \(5, 3\)"):
        Stored({"w": torch.zeros(5, 3)}, "--init-from X").read("w", p, (4, 3), box)
    assert torch.equal(Stored({"w": torch.ones(4, 3)}, "--init-from X").read("w", p, (4, 3), ((1, 0), (2, 3))),
                       torch.ones(2, 3))
