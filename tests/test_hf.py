"""Hugging Face interop against transformers itself: import, export, round trips,
``--init-from``, ``load_model``, generation from a Hugging Face directory, JSON-lines data.

No network: the Hugging Face models are built from a config with random weights and
``save_pretrained`` into temporary directories; the tokenizer is a byte-level BPE
trained here on a few hundred made-up sentences. Models are tiny and in fp64, where
gridtrain's Decoder-2 and transformers' agree to rounding (about 1e-15).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel  # noqa: E402

import gridtrain  # noqa: E402
from gridtrain import checkpoint, cli  # noqa: E402
from gridtrain.data import (DataError, GlobalBatchSampler, build_datasets, collate, load_tokenizer,  # noqa: E402
                            load_tokens)
from gridtrain.checkpoint.huggingface import apply_init_from, check_init_from  # noqa: E402
from gridtrain.config import preset_config  # noqa: E402
from gridtrain.models.hf_mapping import GPT2, LLAMA  # noqa: E402
from gridtrain.models.decoder import Decoder, IGNORE_INDEX, init_parameters  # noqa: E402
from tests.training import relative_difference, tiny_config, train_in_process, train_layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the cat dog bird sat ran flew on under over a mat tree house and then quickly slowly "
         "big small red green saw heard").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json with GPT-2's end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(300), trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def hf_gpt2(directory: Path, tokenizer_file: Path | None, *, seed: int = 0, tie: bool = True, **shape) -> GPT2LMHeadModel:
    """A random GPT-2 in fp64 saved by transformers into ``directory`` (with the
    tokenizer); every weight perturbed, so that no bias is zero and no norm is one."""
    torch.manual_seed(seed)
    vocab = load_tokenizer(tokenizer_file).vocab_size if tokenizer_file else 257
    config = GPT2Config(**{**dict(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=vocab,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie), **shape})
    model = GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, directory / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tokenizer_file) -> tuple[Path, GPT2LMHeadModel]:
    directory = tmp_path_factory.mktemp("hf")
    return directory, hf_gpt2(directory, tokenizer_file)


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    assert cli.main(["import-hf", str(hf_dir[0]), "--out", str(out)]) == 0
    return out


def stored(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in a directory, by name."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def gridtrain_loss(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, as transformers computes it with labels=tokens."""
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)
    return model(tokens, labels).sum() / labels[:, :-1].numel()


# ---- import: the same model as transformers' ---------------------------------------------------


def test_import_gives_transformers_logits_loss_and_gradients(hf_dir, imported):
    """transformers computes its own loss in fp32 (it upcasts the logits: 4e-7 off), so
    its loss here is the same mean next-token cross entropy taken on its fp64 logits."""
    directory, hf = hf_dir
    tokens = torch.randint(0, hf.config.vocab_size, (3, hf.config.n_positions), generator=torch.Generator().manual_seed(1))
    hf.zero_grad()
    logits = hf(input_ids=tokens).logits
    hf_loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    hf_loss.backward()
    assert abs(hf_loss.item() - hf(input_ids=tokens, labels=tokens).loss.item()) < 1e-5  # the same loss
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for source in (imported, directory):  # the checkpoint, and the Hugging Face directory itself
        model = gridtrain.load_model(source, dtype=torch.float64)
        assert relative_difference(model(tokens).detach(), logits.detach()) <= 1e-9
        loss = gridtrain_loss(model, tokens)
        assert abs(loss.item() - hf_loss.item()) <= 1e-9 * hf_loss.item()
        loss.backward()
        ours = dict(model.named_parameters())
        compared = set()
        for r in GPT2.rules_for(model.cfg):
            grads = [ours[n].grad[: model.cfg.vocab_size] if n.startswith("embedding.word") else ours[n].grad
                     for n in r.ours]
            for name, grad in zip(r.theirs, r.transform.to_hf(grads, model.cfg)):
                assert relative_difference(grad, hf_grads[name]) <= 1e-9, name
                compared.add(name)
        assert compared == set(hf_grads)  # every gradient of transformers' model


def test_imported_checkpoint_is_a_step_0_checkpoint_that_load_accepts(imported, hf_dir):
    step = checkpoint.check_loadable(imported)
    assert step.name == "step_0000000" and (imported / "latest").read_text() == step.name
    manifest = json.loads((step / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["meta.json", "model-pp000.safetensors", "tokenizer.json"]
    meta = checkpoint.read_meta(imported)
    assert meta["step"] == 0 and meta["config"]["model"]["d_model"] == 32
    model = Decoder(checkpoint.saved_model(imported))
    assert checkpoint.load_checkpoint(imported, model, torch.optim.AdamW(model.parameters())) == 0


# ---- export: transformers reads what gridtrain writes ------------------------------------------


EXPORTED = {  # preset, model fields
    "gpt2-tied": ("tiny", dict(tie_embeddings=True)),
    "gpt2-untied": ("tiny", dict(tie_embeddings=False)),
    "llama-gqa-untied": ("llama-tiny", dict(seq_len=32, n_kv_head=2, tie_embeddings=False)),
    "llama-llama3-tied": ("llama-tiny", dict(seq_len=32, n_kv_head=None, tie_embeddings=True, rope_scaling="llama3",
                                             rope_original_max_positions=8)),
}


@pytest.mark.parametrize("case", EXPORTED)
def test_export_loads_in_transformers_with_gridtrain_logits(tmp_path, case, monkeypatch):
    keep_hf_rmsnorm_in_fp64(monkeypatch)  # a no-op for GPT-2
    cfg = tiny_config()
    preset, fields = EXPORTED[case]
    cfg.model = dataclasses.replace(preset_config(preset).model, **fields)
    model = Decoder(cfg.model).double()
    init_parameters(model, 5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    checkpoint.save_checkpoint(tmp_path / "run", 3, model, None, cfg)
    assert cli.main(["export-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == cfg.model.arch and config["eos_token_id"] == 256 and config["dtype"] == "float64"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    assert type(hf).__name__ == config["architectures"][0]
    tokens = torch.randint(0, 257, (2, cfg.model.seq_len))
    expected = model(tokens).detach()
    assert relative_difference(hf(input_ids=tokens).logits.detach(), expected) <= 1e-9
    assert torch.equal(gridtrain.load_model(tmp_path / "run", dtype=torch.float64)(tokens).detach(), expected)


@pytest.mark.parametrize("shard", [None, "6KB"], ids=["one-file", "sharded"])
def test_import_export_round_trip_is_bit_exact(hf_dir, imported, tmp_path, shard):
    directory, _ = hf_dir
    argv = ["export-hf", "--load", str(imported), "--out", str(tmp_path / "hf")]
    assert cli.main(argv + (["--max-shard-size", shard] if shard else [])) == 0
    original, exported = stored(directory), stored(tmp_path / "hf")
    assert exported.keys() == original.keys()
    for name, value in original.items():
        assert value.dtype == exported[name].dtype and torch.equal(value, exported[name]), name
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    if shard is None:
        assert files == ["model.safetensors"]
        return
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    # and the sharded directory imports back to the same checkpoint
    assert cli.main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "again")]) == 0
    first, again = (stored(checkpoint.resolve(d)) for d in (imported, tmp_path / "again"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.spawn
@pytest.mark.parametrize("preset, world, tp, pp, tensors", [("tiny", 4, 2, 2, 4 + 12 * 2),
                                                            ("llama-tiny", 8, 4, 2, 3 + 9 * 2)],
                         ids=["gpt2-tp2-pp2", "llama-tp4-pp2"])
def test_grid_checkpoint_exports_the_same_tensors_as_one_process(tmp_path, preset, world, tp, pp, tensors):
    """The Llama on tp 4 has 2 kv heads: each is replicated on two ranks."""
    exports = []
    for name, size, layout in (("one", 1, (1, 1)), ("grid", world, (tp, pp))):
        cfg = tiny_config(steps=2, save=str(tmp_path / name), global_batch_size=4)
        cfg.model = dataclasses.replace(preset_config(preset).model, seq_len=32)
        cfg.parallel.tp, cfg.parallel.pp = layout
        train_in_process(cfg) if size == 1 else train_layout(cfg, size)
        assert cli.main(["export-hf", "--load", str(tmp_path / name), "--out", str(tmp_path / f"{name}-hf")]) == 0
        exports.append(stored(tmp_path / f"{name}-hf"))
    one, grid = exports
    assert one.keys() == grid.keys() and len(one) == tensors
    for name in one:
        assert relative_difference(grid[name], one[name]) <= 1e-9, name


@pytest.mark.spawn
def test_zero3_run_exports_and_loads_in_transformers_with_its_logits(tmp_path, monkeypatch):
    """A ZeRO-3 dp 4 run (each rank holds a quarter of every parameter) saves, exports
    tensor by tensor, and transformers computes the run's own logits from the export."""
    keep_hf_rmsnorm_in_fp64(monkeypatch)
    cfg = tiny_config(steps=2, save=str(tmp_path / "run"), global_batch_size=4, micro_batch_size=1)
    cfg.model = dataclasses.replace(preset_config("llama-tiny").model, seq_len=32, n_kv_head=2, tie_embeddings=False)
    cfg.parallel.dp, cfg.parallel.zero = 4, 3
    train_layout(cfg, 4)
    assert cli.main(["export-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    tokens = torch.randint(0, 257, (2, 32))
    run = gridtrain.load_model(tmp_path / "run", dtype=torch.float64)
    assert relative_difference(hf(input_ids=tokens).logits.detach(), run(tokens).detach()) <= 1e-9


# ---- Llama: the same, through the Llama table ---------------------------------------------------

LLAMA_SHAPES = {"gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
                "llama3-tied": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8})}


def hf_llama(directory: Path, *, seed: int = 0, **shape) -> "transformers.LlamaForCausalLM":
    """A random Llama in fp64 saved by transformers into ``directory``, every weight
    perturbed (no norm is one)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**dict(vocab_size=300, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=0,
                                                eos_token_id=0, tie_word_embeddings=False), **shape})
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def keep_hf_rmsnorm_in_fp64(monkeypatch) -> None:
    """transformers' LlamaRMSNorm normalises in fp32 whatever the input's dtype, which
    caps fp64 agreement near 1e-7; this makes it keep fp64 (its rotary angles are fp32,
    as gridtrain's are, so nothing else differs)."""
    from transformers.models.llama import modeling_llama

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf-llama")
    return directory, hf_llama(directory, **LLAMA_SHAPES["gqa-untied"])


def test_llama_import_gives_transformers_logits_loss_and_gradients(llama_dir, tmp_path, monkeypatch):
    """fp64 on both sides. As transformers ships it, its RMSNorm rounds to fp32, so logits
    agree to 1.3e-7, gradients to 3.6e-7 and the loss to 6e-10 (measured; bounded here at
    1e-6); with its RMSNorm kept in fp64 (keep_hf_rmsnorm_in_fp64: its rotary angles are fp32,
    as gridtrain's are) all agree to rounding, 1e-15 (bounded at 1e-12)."""
    directory, hf = llama_dir
    assert cli.main(["import-hf", str(directory), "--out", str(tmp_path / "ckpt")]) == 0
    tokens = torch.randint(0, hf.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1))
    for tolerance in (1e-6, 1e-12):
        if tolerance == 1e-12:
            keep_hf_rmsnorm_in_fp64(monkeypatch)
        hf.zero_grad()
        logits = hf(input_ids=tokens).logits
        hf_loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        hf_loss.backward()
        hf_grads = {n: p.grad for n, p in hf.named_parameters()}
        for source in (tmp_path / "ckpt", directory):
            model = gridtrain.load_model(source, dtype=torch.float64)
            assert model.cfg.arch == "llama" and model.cfg.kv_heads == 2
            assert relative_difference(model(tokens).detach(), logits.detach()) <= tolerance
            loss = gridtrain_loss(model, tokens)
            assert abs(loss.item() - hf_loss.item()) <= tolerance * hf_loss.item()
            loss.backward()
            ours = dict(model.named_parameters())
            compared = set()
            for r in LLAMA.rules_for(model.cfg):
                grads = [ours[n].grad[: model.cfg.vocab_size] if n in ("embedding.word.weight", "head")
                         else ours[n].grad for n in r.ours]
                for name, grad in zip(r.theirs, r.transform.to_hf(grads, model.cfg)):
                    assert relative_difference(grad, hf_grads[name]) <= tolerance, name
                    compared.add(name)
            assert compared == set(hf_grads)


@pytest.mark.parametrize("shape", LLAMA_SHAPES)
def test_llama_import_export_round_trip_is_bit_exact(tmp_path, shape):
    hf_llama(tmp_path / "hf", **LLAMA_SHAPES[shape])
    assert cli.main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli.main(["export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    original, exported = stored(tmp_path / "hf"), stored(tmp_path / "back")
    assert exported.keys() == original.keys()
    for name, value in original.items():
        assert value.dtype == exported[name].dtype and torch.equal(value, exported[name]), name
    # and the config says the same model
    first, again = (transformers.AutoConfig.from_pretrained(tmp_path / d) for d in ("hf", "back"))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "rope_parameters"):
        assert getattr(first, key) == getattr(again, key), key


@pytest.mark.parametrize("key, value, words", [
    ("attention_bias", True, "attention_bias True is not supported"),
    ("mlp_bias", True, "mlp_bias True is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling type 'yarn' is not supported"),
])
def test_llama_variant_gridtrain_lacks_is_one_line(llama_dir, tmp_path, key, value, words, capsys):
    directory = tmp_path / "variant"
    shutil.copytree(llama_dir[0], directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters", None) if key == "rope_scaling" else None
    (directory / "config.json").write_text(json.dumps({**config, key: value}))
    assert cli.main(["import-hf", str(directory), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and not (tmp_path / "ckpt").exists()


# ---- fine-tuning from a Hugging Face directory -----------------------------------------------------


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = [json.dumps({"text": s, "id": i}) for i, s in enumerate(sentences(700, seed=1))]
    path.write_text("\n".join(lines[:5] + ["", json.dumps({"text": ""})] + lines[5:]) + "\n")
    return path


def hf_first_batch_loss(hf, tokenizer_file, data, seq_len, seed, global_batch) -> float:
    """transformers' mean token loss on step 1's global batch of a gridtrain run."""
    train, _, _ = build_datasets(data, load_tokenizer(tokenizer_file), seq_len)
    ids = GlobalBatchSampler(len(train), global_batch, global_batch, seed=seed).global_batch(0)
    batch = collate(train, ids)
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()


@pytest.mark.spawn
def test_init_from_hf_dir_on_tp2_starts_from_its_weights(hf_dir, imported, tokenizer_file, jsonl, tmp_path):
    """Step 1's loss of a tp 2 run started from the Hugging Face directory (its own
    tokenizer, JSON-lines data) is transformers' loss on that batch; so is that of a
    one-process run started from the imported checkpoint."""
    directory, hf = hf_dir
    expected = hf_first_batch_loss(hf, tokenizer_file, jsonl, 32, seed=3, global_batch=4)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--init-from", str(directory), "--tp", "2",
                           "--nproc", "2", "--dtype", "fp64", "--steps", "1", "--data", str(jsonl), "--seed", "3",
                           "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0",
                           "--metrics-file", str(metrics), "--no-progress", "--save", str(tmp_path / "tuned")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert abs(loss - expected) <= 1e-9 * expected
    saved = checkpoint.read_meta(tmp_path / "tuned")["config"]
    assert saved["model"]["d_model"] == 32 and saved["data"]["tokenizer"] == str(directory.resolve() / "tokenizer.json")

    cfg = tiny_config(steps=1, seed=3, global_batch_size=4, micro_batch_size=2, init_from=str(imported))
    cfg.data.path = str(jsonl)
    apply_init_from(cfg)
    assert cfg.data.tokenizer.endswith("tokenizer.json")
    assert abs(train_in_process(cfg)["losses"][0] - expected) <= 1e-9 * expected


def test_init_from_llama_takes_another_seq_len(llama_dir, jsonl, monkeypatch):
    """Rotary positions have no weights: a run may start from a Llama with a shorter
    window (here 16 of its 32) and its first loss is transformers' on that batch
    (1e-6: transformers' RMSNorm is fp32); GPT-2's learned positions still refuse it."""
    directory, hf = llama_dir
    expected = hf_first_batch_loss(hf, None, jsonl, 16, seed=3, global_batch=4)
    cfg = tiny_config(steps=1, seed=3, global_batch_size=4, micro_batch_size=2, init_from=str(directory))
    cfg.data.path, cfg.model.seq_len = str(jsonl), 16
    apply_init_from(cfg, {"seq_len"})
    assert (cfg.model.arch, cfg.model.seq_len, cfg.model.max_positions) == ("llama", 16, 32)
    check_init_from(cfg)
    assert abs(train_in_process(cfg)["losses"][0] - expected) <= 1e-6 * expected


@pytest.mark.spawn
def test_init_from_llama_fine_tunes_longer_on_cp2(jsonl, tmp_path):
    """Long-context fine-tuning: from a Hugging Face Llama with Llama 3 rope scaling and a
    32-token context, `train --init-from DIR --seq-len 64 --cp 2` (each rank 32 tokens at
    their true positions, rope scaling from the source's config): step 1's loss is
    transformers' on that batch of 64-token sequences (1e-6: its RMSNorm is fp32)."""
    directory = tmp_path / "hf"
    hf = hf_llama(directory, **LLAMA_SHAPES["llama3-tied"])
    expected = hf_first_batch_loss(hf, None, jsonl, 64, seed=3, global_batch=4)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--init-from", str(directory), "--cp", "2",
                           "--seq-len", "64", "--nproc", "2", "--dtype", "fp64", "--steps", "1", "--data", str(jsonl),
                           "--seed", "3", "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval",
                           "0", "--metrics-file", str(metrics), "--no-progress"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cp 2" in proc.stdout
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert abs(loss - expected) <= 1e-6 * expected


def test_init_from_gives_zero1_its_master_weights(imported, jsonl):
    """ZeRO-1 keeps its own flat copy of the weights: it too starts from the source, so
    two steps equal plain AdamW's."""
    runs = []
    for zero in (0, 1):
        cfg = tiny_config(steps=2, global_batch_size=4, micro_batch_size=2, init_from=str(imported), zero=zero)
        cfg.data.path = str(jsonl)
        runs.append(train_in_process(apply_init_from(cfg))["losses"])
    assert relative_difference(runs[0], runs[1]) <= 1e-9


def test_generate_from_hf_dir_uses_its_tokenizer(hf_dir, tokenizer_file, capsys):
    directory, hf = hf_dir
    tokenizer = load_tokenizer(tokenizer_file)
    prompt = "The cat sat"
    ids = torch.tensor([tokenizer.encode(prompt)])
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    assert cli.main(["generate", "--load", str(directory), "--prompt", prompt, "--max-new-tokens", "8",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(greedy[0].tolist()) + "\n"


# ---- JSON lines ----------------------------------------------------------------------------------


def test_jsonl_documents_are_packed_with_end_of_text(tmp_path):
    from gridtrain.data import ByteTokenizer

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ab"}\n\n{"text": ""}\n{"text": "c\\u00e9", "x": 1}\n')
    assert load_tokens(path, ByteTokenizer()).tolist() == [97, 98, 256, 99, 0xC3, 0xA9]


@pytest.mark.parametrize("line, words", [('{"text": 3}', 'line 2 has no string "text" field'),
                                         ("[1, 2]", 'line 2 has no string "text" field'),
                                         ('{"text": "x"', "line 2 is not JSON")])
def test_bad_jsonl_line_is_one_line_before_any_process(tmp_path, line, words, capsys, no_process_may_start):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match="line 2"):
        load_tokens(path, load_tokenizer(None))
    assert cli.main(["train", "--data", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and str(path) in err, err


# ---- bad input: one line, exit status 2, nothing started ---------------------------------------------


def _broken(kind: str, source: Path, tmp_path: Path) -> Path:
    target = tmp_path / kind
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    if kind == "no-config":
        (target / "config.json").unlink()
    elif kind == "unknown-architecture":
        (target / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    elif kind == "garbage-index":
        (target / "model.safetensors.index.json").write_text("{not json")
    elif kind == "index-names-a-missing-shard":
        index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "model-00002-of-00002.safetensors"}}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    elif kind == "wrong-shape":
        (target / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    elif kind == "no-weights":
        (target / "model.safetensors").unlink()
    return target


BROKEN = {"no-config": "no config.json", "unknown-architecture": "model_type 'bert' is not an architecture",
          "garbage-index": "model.safetensors.index.json cannot be read",
          "index-names-a-missing-shard": "names 'model-00002-of-00002.safetensors', which is not a file",
          "wrong-shape": "the weights do not match config.json", "no-weights": "no model.safetensors"}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_bad_hf_dir_is_one_line_for_every_command(kind, hf_dir, tmp_path, capsys, no_process_may_start):
    broken = _broken(kind, hf_dir[0], tmp_path)
    for argv in (["import-hf", str(broken), "--out", str(tmp_path / "out")],
                 ["train", "--init-from", str(broken), "--nproc", "2"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and BROKEN[kind] in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, words", [
    (["train", "--n-layer", "3"], "--n-layer 3 (source: 2)"),
    (["train", "--seq-len", "16"], "--seq-len 16 (source: 32)"),  # GPT-2's positions are weights
    (["train", "--load", "{imported}"], "pass one of them"),
    (["import-hf", "{hf}", "--out", "{imported}"], "exists and is not an empty directory"),
    (["export-hf", "--load", "{missing}", "--out", "{missing}"], "does not exist"),
    (["export-hf", "--load", "{imported}", "--out", "{missing}", "--max-shard-size", "lots"], "not a size"),
    (["generate", "--load", "{empty}"], "neither a Hugging Face model directory"),
], ids=["contradicting-flag", "gpt2-seq-len", "with-load", "import-over-a-checkpoint", "export-missing",
        "bad-shard-size", "generate-neither"])
def test_bad_hf_command_is_one_line(argv, words, hf_dir, imported, tmp_path, capsys, no_process_may_start):
    (tmp_path / "empty").mkdir()
    paths = dict(hf=hf_dir[0], imported=imported, missing=tmp_path / "missing", empty=tmp_path / "empty")
    argv = [a.format(**paths) for a in argv]
    if argv[0] == "train":
        argv += ["--init-from", str(hf_dir[0]), "--nproc", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


def test_load_model_is_exported_and_keeps_the_run_fields(hf_dir):
    model = gridtrain.load_model(hf_dir[0])
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert dataclasses.asdict(model.cfg)["attention"] == "sdpa"
    assert np.isfinite(model(torch.zeros(1, 4, dtype=torch.long)).detach().numpy()).all()
