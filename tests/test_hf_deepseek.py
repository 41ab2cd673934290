"""Hugging Face interop for DeepSeek-V3 (``DeepseekV3ForCausalLM``: latent attention,
sigmoid routing with a selection bias and expert groups, shared experts, dense first
layers, multi-token prediction) and DeepSeek-V2 (softmax routing), against transformers
itself.

No network. transformers builds a tiny DeepSeek-V3 (d 64, 3 layers: 1 dense, 2 MoE of 8
experts in 4 groups, 2 chosen groups, 1 shared expert; q compressed to 32, kv to 16;
YaRN; rope_interleave true, DeepSeek's own rotary layout) in fp32, every weight and the
selection bias perturbed. A fourth layer of the same model becomes the block of an MTP
module, stored as DeepSeek stores it (``model.layers.3.*``, with enorm, hnorm, eh_proj,
shared_head.norm and the copies of the embedding and the head), beside a
``num_hidden_layers`` 3 config: the Hub's layout. transformers 5's own layout
(``save_original_format=False``: stacked experts) is saved without the MTP module,
as transformers' model has none.

In fp32 gridtrain's logits are transformers' to 1e-5 (absolute); in fp64, with
transformers' fp32 steps (RMSNorm, the router's sigmoid) made fp64, to 1e-12.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

import gridtrain  # noqa: E402
from gridtrain import checkpoint, cli  # noqa: E402
from gridtrain.checkpoint.huggingface import HFDirectory  # noqa: E402
from gridtrain.config import preset_config  # noqa: E402
from gridtrain.data import ByteTokenizer  # noqa: E402
from gridtrain.models.decoder import Decoder, generate, init_parameters  # noqa: E402
from gridtrain.models.hf_mapping import FUSED, HUB  # noqa: E402
from gridtrain.parallel.tensor_parallel import vocab_parallel_embedding  # noqa: E402
from tests import test_llama  # noqa: E402
from tests.test_hf import stored  # noqa: E402
from tests.training import relative_difference, tiny_config  # noqa: E402

LAYERS, D = 3, 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
COMMON = dict(vocab_size=257, hidden_size=D, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
              kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4,
              topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
              rope_interleave=True, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256,
              rope_parameters=YARN)
MTP_KEYS = [r"model\.layers\.3\..*"]  # what transformers' DeepSeek-V3 leaves unread (its own list: layer 61's)

one_thread = test_llama.one_thread  # autouse: in-process models on one thread


def perturbed(model):
    """Every weight moved off its initial value (norms off one), the selection bias random."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def load_hf(directory: Path, **kwargs):
    """transformers' DeepSeek-V3 from ``directory``, the MTP layer left unread (as it
    leaves DeepSeek-V3's layer 61)."""
    with mock.patch.object(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", MTP_KEYS):
        model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
            directory, experts_implementation="eager", output_loading_info=True, **kwargs)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def with_mtp_module(raw: Path, out: Path) -> None:
    """``raw``'s 4-layer model as DeepSeek publishes one: 3 layers and one MTP module,
    whose block is layer 3 (with its norms, projection and copies of the embedding and
    the head)."""
    tensors = load_file(raw / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    tensors.update({
        f"model.layers.{LAYERS}.enorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        f"model.layers.{LAYERS}.hnorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        f"model.layers.{LAYERS}.eh_proj.weight": 0.1 * torch.randn(D, 2 * D, generator=g),
        f"model.layers.{LAYERS}.shared_head.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
        f"model.layers.{LAYERS}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        f"model.layers.{LAYERS}.shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((raw / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers' 3-layer model, {layout: directory}): the Hub's layout with the MTP
    module, transformers 5's without."""
    config = transformers.DeepseekV3Config(**COMMON, num_hidden_layers=LAYERS + 1)
    raw = tmp_path_factory.mktemp("deepseek-raw")
    perturbed(transformers.DeepseekV3ForCausalLM(config)).save_pretrained(raw)
    dirs = {HUB: tmp_path_factory.mktemp("deepseek-hub"), FUSED: tmp_path_factory.mktemp("deepseek-fused")}
    with_mtp_module(raw, dirs[HUB])
    hf = load_hf(dirs[HUB])
    hf.save_pretrained(dirs[FUSED], save_original_format=False)
    return hf, dirs


def fp64_norms_and_router(monkeypatch) -> None:
    """transformers' RMSNorm and DeepSeek-V3 router without their fp32 steps (the norm's
    normalisation; the router's logits, sigmoid and choice), written from the formulas."""
    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def router(self, hidden):
        hidden = hidden.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden, self.weight.to(hidden.dtype))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(scores.dtype)
        e, g = self.num_experts, self.num_group
        best = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]
        allowed = torch.zeros(choice.shape[0], g, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(e // g, dim=1), float("-inf"))
        chosen = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights * self.routed_scaling_factor, chosen

    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", norm)
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3TopkRouter, "forward", router)


def tokens(n: int = 2, length: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(hf, model, x: torch.Tensor, monkeypatch) -> None:
    """``model`` (fp32) gives transformers' fp32 logits to 1e-5; both in fp64, with
    transformers' fp32 steps made fp64 (they stay patched), to 1e-12."""
    with torch.no_grad():
        assert (hf(input_ids=x).logits - model(x)).abs().max() <= 1e-5
        fp64_norms_and_router(monkeypatch)
        assert relative_difference(copy.deepcopy(hf).double()(input_ids=x).logits,
                                   copy.deepcopy(model).double()(x)) <= 1e-12


# ---- import: the same model as transformers' ----------------------------------------------------


@pytest.mark.parametrize("layout", [HUB, FUSED])
def test_import_gives_transformers_logits(saved, layout, tmp_path, monkeypatch):
    """Either layout, through import-hf's checkpoint and straight from the directory.
    The Hub's files hold one MTP module and so does the model; transformers' own (same
    config.json, no module) give the main model alone."""
    hf, dirs = saved
    source = HFDirectory(dirs[layout]).check()
    assert source.layout == layout and source.model.mtp_layers == (1 if layout == HUB else 0)
    assert cli.main(["import-hf", str(dirs[layout]), "--out", str(tmp_path / "ckpt")]) == 0
    x = tokens()
    for where in (tmp_path / "ckpt", dirs[layout]):
        model = gridtrain.load_model(where)
        m = model.cfg
        assert (m.mla, m.q_lora_rank, m.kv_lora_rank, m.moe_router, m.moe_groups, m.moe_group_top_k) == \
            (True, 32, 16, "sigmoid", 4, 2)
        assert (m.moe_dense_layers, m.moe_shared_experts, m.moe_routed_scale, m.rope_scaling) == (1, 1, 2.5, "yarn")
        bias = model.blocks["1"].mlp.expert_bias
        assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
        assert_same_logits(hf, model, x, monkeypatch)


def test_interleaved_and_plain_rotary_rows_both_read(saved, tmp_path):
    """DeepSeek's rotary rows pair features 0 1, 2 3, ... (rope_interleave true),
    gridtrain's i and i + r/2: the importer de-interleaves them. The same tensors read
    as already in halves (rope_interleave false) are another model, which gridtrain
    reads as transformers does too."""
    hf, dirs = saved
    halves = tmp_path / "halves"
    shutil.copytree(dirs[FUSED], halves)
    config = json.loads((halves / "config.json").read_text())
    (halves / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    x = tokens()
    with torch.no_grad():
        plain = transformers.DeepseekV3ForCausalLM.from_pretrained(halves, experts_implementation="eager").eval()
        expected = plain(input_ids=x).logits
        assert (hf(input_ids=x).logits - expected).abs().max() > 1e-2  # the layout matters
        assert (gridtrain.load_model(halves)(x) - expected).abs().max() <= 1e-5


def test_mtp_module_is_transformers_mtp_layer(saved):
    """The MTP module read from DeepSeek's layer 3 (enorm, hnorm, eh_proj, its block,
    shared_head.norm) computes what transformers' MtpModel computes from the same
    files, given the main model's state after its final norm (which gridtrain's mtp.py,
    transformers' drafting, vLLM's and SGLang's all feed it)."""
    _, dirs = saved
    hf, model = load_hf(dirs[HUB]), gridtrain.load_model(dirs[HUB])  # (save_pretrained leaves a dtype MtpModel refuses)
    with mock.patch.object(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", MTP_KEYS):
        mtp = transformers.modeling_layers.MtpModel.from_pretrained(hf).eval()
    x = tokens()
    with torch.no_grad():
        hidden = hf(input_ids=x, output_hidden_states=True).hidden_states[-1]  # the final norm's output
        positions = torch.arange(x.shape[1] - 1).expand(x.shape[0], -1)
        expected = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=x[:, 1:])
        later = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)  # token i + 1 at position i
        embedded = vocab_parallel_embedding(later, model.input_weight(), model.tp)
        ours = model.mtp[0].final_norm(model.mtp[0](embedded, hidden, model.recompute))
    assert (ours[:, :-1] - expected).abs().max() <= 1e-5


def test_init_from_without_mtp_weights_draws_them(saved, tmp_path):
    """--init-from transformers' files (no MTP module) with --mtp-layers 1: the module is
    the initialisation's, the main model the source's; the run's choice, not refused."""
    from gridtrain.checkpoint.huggingface import apply_init_from, check_init_from
    from gridtrain.checkpoint.materialise import Drawn, Start

    _, dirs = saved
    cfg = apply_init_from(tiny_config(init_from=str(dirs[FUSED]), mtp_layers=1, seq_len=32), {"mtp_layers", "seq_len"})
    assert cfg.model.mtp_layers == 1 and cfg.model.mla
    check_init_from(cfg)
    with torch.device("meta"):
        model = Decoder(cfg.model)
    source = HFDirectory(dirs[FUSED]).check()
    start = Start.of(cfg, model, init=source)
    start.materialise(model, types.SimpleNamespace(device="cpu", param_dtype=torch.float32, tp=model.tp))
    fresh = Decoder(cfg.model)
    init_parameters(fresh, cfg.training.seed)
    assert isinstance(start.values.fresh, Drawn)
    assert torch.equal(model.mtp[0].proj.weight, fresh.mtp[0].proj.weight)
    assert torch.equal(model.blocks["0"].attn.kv_b.weight, source.tensors["blocks.0.attn.kv_b.weight"])


def test_generate_from_the_directory_gives_transformers_greedy_tokens(saved):
    """Greedy generation from the directory (latent cache, and without it) gives
    transformers' own greedy tokens."""
    hf, dirs = saved
    ids = torch.tensor([ByteTokenizer().encode("The cat sat")])
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    model = gridtrain.load_model(dirs[HUB])
    assert torch.equal(generate(model, ids, 10, temperature=0), greedy)
    assert torch.equal(generate(model, ids, 10, temperature=0, use_cache=False), greedy)


# ---- export: transformers reads what gridtrain writes -------------------------------------------


@pytest.mark.parametrize("layout", [HUB, FUSED])
def test_import_export_round_trip_is_bit_exact(saved, layout, tmp_path):
    """Import then export gives back the Hub layout's files tensor for tensor (rotary
    rows interleaved again), but the MTP module's copies of the embedding and the head
    (the main model's); the config says the same model."""
    hf, dirs = saved
    copies = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight")
    original = {k: v for k, v in stored(dirs[HUB]).items() if not copies.fullmatch(k)}
    if layout == FUSED:
        original = {k: v for k, v in original.items() if not k.startswith(f"model.layers.{LAYERS}.")}
    assert cli.main(["import-hf", str(dirs[layout]), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli.main(["export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    exported = stored(tmp_path / "hf")
    assert exported.keys() == original.keys()
    for name, value in original.items():
        assert value.dtype == exported[name].dtype and torch.equal(value, exported[name]), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_interleave"] is True and config["q_lora_rank"] == 32
    assert config["num_nextn_predict_layers"] == (1 if layout == HUB else 0)
    again = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "n_group", "topk_group",
                "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps",
                "rope_parameters", "rope_interleave"):
        plain = lambda v: {k: x for k, x in v.items() if k != "type"} if isinstance(v, dict) else v  # noqa: E731
        assert plain(getattr(again, key)) == plain(getattr(hf.config, key)), key  # (DeepSeek's code reads "type")


def test_export_of_the_tiny_preset_loads_in_transformers(tmp_path, monkeypatch):
    """A gridtrain run's checkpoint of ``deepseek-tiny`` (every feature) exports to files
    AutoModelForCausalLM loads with nothing missing, giving gridtrain's logits; the MTP
    module is written as DeepSeek's layer n_layer, which transformers leaves unread."""
    cfg = tiny_config()
    cfg.model = dataclasses.replace(preset_config("deepseek-tiny").model, seq_len=32, max_positions=64)
    model = Decoder(cfg.model)
    init_parameters(model, 5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
        model.blocks["1"].mlp.expert_bias.copy_(0.1 * torch.randn(8))
    checkpoint.save_checkpoint(tmp_path / "run", 3, model, None, cfg)
    assert cli.main(["export-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    with mock.patch.object(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected",
                           [r"model\.layers\.2\..*"]):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager")
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert "model.layers.2.eh_proj.weight" in stored(tmp_path / "hf")
    assert_same_logits(hf.eval(), model.eval(), tokens(), monkeypatch)


@pytest.mark.parametrize("preset, fields, words", [
    ("moe-tiny", dict(moe_router="sigmoid"), "DeepSeek-V3's routing"),
    ("moe-tiny", dict(qk_norm="head", attn_head_dim=12, moe_groups=2), "DeepSeek-V3's routing"),
    ("deepseek-tiny", dict(moe_every=2, n_layer=3, moe_dense_layers=0), "dense layers between its MoE layers"),
    ("deepseek-tiny", dict(moe_shared_experts=0), "no shared expert"),
    ("deepseek-tiny", dict(moe_router="softmax", moe_expert_bias_rate=0.0, moe_groups=1, moe_group_top_k=None),
     "renormalised top-k weights"),
])
def test_export_of_what_no_family_fits_is_one_line(tmp_path, preset, fields, words, capsys):
    cfg = tiny_config()
    cfg.model = dataclasses.replace(preset_config(preset).model, seq_len=32, **fields)
    checkpoint.save_checkpoint(tmp_path / "run", 1, Decoder(cfg.model), None, cfg)
    assert cli.main(["export-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err


# ---- what gridtrain cannot read: one line --------------------------------------------------------


@pytest.mark.parametrize("changes, words", [
    (dict(scoring_func="softmax"), "scoring_func 'softmax' is not supported"),
    (dict(quantization_config={"quant_method": "fp8"}), "convert them to bf16 first"),
    (dict(num_key_value_heads=2), "latent attention has a key and a value per head"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2 is not supported"),
    (dict(rope_parameters={**YARN, "mscale_all_dim": None}), "mscale without mscale_all_dim"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "type 'linear'"),
])
def test_variant_gridtrain_lacks_is_one_line(saved, tmp_path, changes, words, capsys):
    directory = tmp_path / "variant"
    shutil.copytree(saved[1][FUSED], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    assert cli.main(["import-hf", str(directory), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "ckpt").exists()


# ---- DeepSeek-V2: softmax routing ----------------------------------------------------------------


def test_deepseek_v2_imports_and_exports(tmp_path):
    """A DeepSeek-V2 (softmax scores, top-k not renormalised, no query compression, two
    shared experts): transformers' logits, and import then export gives its files back."""
    v2 = {k: v for k, v in COMMON.items() if k not in ("rope_interleave", "n_group", "topk_group")}
    config = transformers.DeepseekV2Config(**{**v2, "q_lora_rank": None, "n_shared_experts": 2,
                                              "routed_scaling_factor": 1.5, "topk_method": "greedy",
                                              "num_hidden_layers": LAYERS}, experts_implementation="eager")
    hf = perturbed(transformers.DeepseekV2ForCausalLM(config))
    hf.save_pretrained(tmp_path / "v2")
    model = gridtrain.load_model(tmp_path / "v2")
    assert (model.cfg.moe_router, model.cfg.moe_norm_topk, model.cfg.q_lora_rank) == ("softmax", False, 0)
    with torch.no_grad():
        assert (hf(input_ids=tokens()).logits - model(tokens())).abs().max() <= 1e-5
    assert cli.main(["import-hf", str(tmp_path / "v2"), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli.main(["export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    original, exported = stored(tmp_path / "v2"), stored(tmp_path / "back")
    assert original.keys() == exported.keys() and all(torch.equal(v, exported[k]) for k, v in original.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["DeepseekV2ForCausalLM"]


# ---- trained on pp 2 x dp 2 with ep 2, then exported ---------------------------------------------


@pytest.mark.spawn
def test_a_pp2_ep2_run_from_deepseek_v3_exports_to_transformers(saved, tmp_path, monkeypatch):
    """The Hub's files (with the MTP module) imported with --init-from, trained two steps
    on 4 processes (pp 2 x dp 2, experts over ep 2: each rank holds 4 of a stage's
    layer's 8; the MTP module on the last stage, which looks tokens up in its copy of the
    embedding; the selection bias moved), saved, exported: transformers loads the export
    with the trained model's logits (read back whole with gridtrain.load_model)."""
    hf, dirs = saved
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(dirs[HUB]), "--nproc", "4", "--pp", "2", "--ep", "2", "--seq-len", "32",
            "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "1", "--moe-expert-bias-rate", "0.01",
            "--eval-interval", "0", "--sample-tokens", "0", "--no-progress", "--save", str(run)]
    assert cli.main(argv) == 0
    trained, initial = gridtrain.load_model(run), gridtrain.load_model(dirs[HUB])
    params = dict(initial.named_parameters())
    for part in (".experts.", "mtp.0.", "attn.kv_b"):
        assert max(relative_difference(p.detach(), params[n].detach()) for n, p in trained.named_parameters()
                   if part in n) > 1e-6, part  # trained, on their ranks, and came back
    assert not torch.equal(trained.blocks["1"].mlp.expert_bias, initial.blocks["1"].mlp.expert_bias)
    assert cli.main(["export-hf", "--load", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert_same_logits(load_hf(tmp_path / "hf"), trained, tokens(seed=4), monkeypatch)
