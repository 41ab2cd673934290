"""Hugging Face interop for mixtures of experts and Qwen3: Mixtral (``MixtralForCausalLM``),
Qwen3-MoE (``Qwen3MoeForCausalLM``), OLMoE (``OlmoeForCausalLM``) and dense Qwen3
(``Qwen3ForCausalLM``), against transformers itself.

No network: each model is built by transformers from a tiny config (d 64, 3 layers, 4-8
experts), its weights perturbed, in fp64, and saved both ways transformers 5 saves: the
Hub's layout (one tensor per expert and matrix: what ``save_pretrained`` writes by
default, and transformers 4) and its in-memory one (``save_original_format=False``:
every expert of a layer stacked in ``gate_up_proj`` and ``down_proj``). transformers'
experts run with ``experts_implementation="eager"`` (its grouped kernel takes no fp64).

As transformers ships them, its RMSNorms normalise in fp32 and its routers take the
softmax in fp32 even in an fp64 model, so logits agree to about 1.5e-7 (tested at 1e-6);
with those two made fp64 (``fp64_norms_and_routers``) they agree to rounding (tested at
1e-12).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
import gridtrain  # noqa: E402
from gridtrain import checkpoint, cli  # noqa: E402
from gridtrain.checkpoint.huggingface import HFDirectory, apply_init_from  # noqa: E402
from gridtrain.config import preset_config  # noqa: E402
from gridtrain.data import ByteTokenizer  # noqa: E402
from gridtrain.models.decoder import Decoder, generate, init_parameters  # noqa: E402
from gridtrain.models.hf_mapping import FUSED, HUB, architecture_for  # noqa: E402
from tests import test_llama  # noqa: E402
from tests.test_hf import stored  # noqa: E402
from tests.training import relative_difference, tiny_config  # noqa: E402

COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
              router_aux_loss_coef=0.0, bos_token_id=256, eos_token_id=256)
FAMILIES = {  # name: (config class, model class, shape beyond COMMON)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                             intermediate_size=24, rope_theta=1e6)),
    # 24-wide heads beside a 64-wide model; layer 1 dense (mlp_only_layers): MoE every second layer
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=3,
                                                                 moe_intermediate_size=16, norm_topk_prob=True,
                                                                 head_dim=24, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=3, intermediate_size=24,
                                                       norm_topk_prob=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")

one_thread = test_llama.one_thread  # autouse: in-process models on one thread, as tests/test_llama.py's


def hf_model(family: str, seed: int = 0, **changes):
    """transformers' model of ``family`` in fp64, every weight perturbed (no norm is one,
    routers far from uniform)."""
    config_class, model_class, shape = FAMILIES[family]
    torch.manual_seed(seed)
    common = COMMON if family in MOE_FAMILIES else {k: v for k, v in COMMON.items() if k != "router_aux_loss_coef"}
    config = getattr(transformers, config_class)(**{**common, **shape, **changes}, experts_implementation="eager")
    model = getattr(transformers, model_class)(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (transformers' model, {layout: directory}): one model per family saved
    in both layouts (the dense Qwen3 has one)."""
    out = {}
    for family in FAMILIES:
        model = hf_model(family)
        dirs = {HUB: tmp_path_factory.mktemp(f"{family}-hub")}
        model.save_pretrained(dirs[HUB])
        if family in MOE_FAMILIES:
            dirs[FUSED] = tmp_path_factory.mktemp(f"{family}-fused")
            model.save_pretrained(dirs[FUSED], save_original_format=False)
        out[family] = model, dirs
    return out


def fp64_norms_and_routers(monkeypatch) -> None:
    """transformers' RMSNorms and top-k routers of these families, without their fp32
    steps (the norm's normalisation, the router's softmax): what is left to differ is
    rounding. Written from the formulas, not transformers' code."""
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.olmoe import modeling_olmoe
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def router(self, hidden):
        logits = F.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        weights, chosen = logits.softmax(-1).topk(self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral's router always renormalises
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, chosen

    for cls in (modeling_mixtral.MixtralRMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm, modeling_olmoe.OlmoeRMSNorm,
                modeling_qwen3.Qwen3RMSNorm):
        monkeypatch.setattr(cls, "forward", norm)
    for cls in (modeling_mixtral.MixtralTopKRouter, modeling_qwen3_moe.Qwen3MoeTopKRouter,
                modeling_olmoe.OlmoeTopKRouter):
        monkeypatch.setattr(cls, "forward", router)


def assert_same_logits(hf, model, x: torch.Tensor, monkeypatch) -> None:
    """transformers' logits equal ``model``'s: to 1e-6 as it ships, to 1e-12 with its fp32
    steps made fp64 (which stay patched afterwards)."""
    for tolerance in (1e-6, 1e-12):
        if tolerance == 1e-12:
            fp64_norms_and_routers(monkeypatch)
        with torch.no_grad():
            assert relative_difference(hf(input_ids=x).logits, model(x)) <= tolerance


def tokens(n: int = 3, length: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))


# ---- import: the same model as transformers' ------------------------------------------------------


@pytest.mark.parametrize("family, layout", [(f, HUB) for f in FAMILIES] + [(f, FUSED) for f in MOE_FAMILIES])
def test_import_gives_transformers_logits(saved, family, layout, tmp_path, monkeypatch):
    """Either layout, through import-hf's checkpoint and straight from the directory:
    transformers' logits to 1e-6 as it ships, to 1e-12 with its fp32 steps made fp64."""
    hf, dirs = saved[family]
    assert HFDirectory(dirs[layout]).layout == (layout if family in MOE_FAMILIES else "")
    assert cli.main(["import-hf", str(dirs[layout]), "--out", str(tmp_path / "ckpt")]) == 0
    x = tokens()
    models = [gridtrain.load_model(source, dtype=torch.float64) for source in (tmp_path / "ckpt", dirs[layout])]
    for tolerance in (1e-6, 1e-12):
        if tolerance == 1e-12:
            fp64_norms_and_routers(monkeypatch)
        with torch.no_grad():
            expected = hf(input_ids=x).logits
            for model in models:
                assert relative_difference(model(x), expected) <= tolerance
    cfg = models[0].cfg
    assert (cfg.head_dim, cfg.qk_norm) == ((16, None) if family == "mixtral" else (24, "head") if family != "olmoe"
                                           else (16, "full"))
    if family == "qwen3_moe":
        assert cfg.moe_layers == [0, 2] and cfg.moe_ffn_size == 16 and cfg.ffn_size == 48 and cfg.moe_norm_topk


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_import_gives_transformers_gradients(saved, family, monkeypatch):
    """The loss's gradient for every weight (both query/key norms, router, each expert),
    compared on transformers' in-memory tensors (the fused layout's names), with its fp32
    steps made fp64: 1e-12."""
    fp64_norms_and_routers(monkeypatch)
    hf, dirs = saved[family]
    x = tokens(2)
    hf.zero_grad()
    loss = F.cross_entropy(hf(input_ids=x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    model = gridtrain.load_model(dirs[HUB], dtype=torch.float64)
    logits = model(x)
    ours = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert abs(ours.item() - loss.item()) <= 1e-12 * loss.item()
    ours.backward()
    params = dict(model.named_parameters())
    compared = set()
    for r in architecture_for({"model_type": family}).rules_for(model.cfg, FUSED):
        grads = [params[n].grad[:model.cfg.vocab_size] if n in ("embedding.word.weight", "head") else params[n].grad
                 for n in r.ours]
        for name, grad in zip(r.theirs, r.transform.to_hf(grads, model.cfg)):
            assert relative_difference(grad, hf_grads[name]) <= 1e-12, name
            compared.add(name)
    assert compared == set(hf_grads)


# ---- export: transformers reads what gridtrain writes -------------------------------------------


EXPORTED = {  # preset, model fields, the family transformers should load
    "mixtral": ("moe-tiny", dict(), "MixtralForCausalLM"),
    "qwen3-moe-dense-layers": ("moe-tiny", dict(qk_norm="head", attn_head_dim=12, moe_every=2, n_layer=3,
                                                 moe_norm_topk=False), "Qwen3MoeForCausalLM"),
    "olmoe": ("moe-tiny", dict(qk_norm="full", moe_norm_topk=False, moe_top_k=3, tie_embeddings=True),
              "OlmoeForCausalLM"),
    "qwen3": ("llama-tiny", dict(qk_norm="head", attn_head_dim=4), "Qwen3ForCausalLM"),
}


def _saved_run(path: Path, preset: str, fields: dict) -> tuple[Decoder, object]:
    """A gridtrain model (fp64, perturbed) saved as a run's checkpoint at ``path``."""
    cfg = tiny_config()
    cfg.model = dataclasses.replace(preset_config(preset).model, seq_len=32, **fields)
    model = Decoder(cfg.model).double()
    init_parameters(model, 5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    checkpoint.save_checkpoint(path, 3, model, None, cfg)
    return model, cfg


@pytest.mark.parametrize("case", EXPORTED)
def test_export_loads_in_transformers_with_gridtrain_logits(tmp_path, case, monkeypatch):
    """A checkpoint with gridtrain's per-expert names exports to the Hub's layout, which
    AutoModelForCausalLM loads with no key missing or left over, giving gridtrain's
    logits (1e-6 as transformers ships; 1e-12 with its fp32 steps made fp64)."""
    preset, fields, hf_class = EXPORTED[case]
    model, cfg = _saved_run(tmp_path / "run", preset, fields)
    assert cli.main(["export-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [hf_class] and config["dtype"] == "float64"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64,
                                                                 experts_implementation="eager",
                                                                 output_loading_info=True)
    assert type(hf).__name__ == hf_class
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_same_logits(hf, model, tokens(2, seed=3), monkeypatch)
    names = stored(tmp_path / "hf")
    if cfg.model.n_experts:  # the Hub's names, one tensor per expert
        expert = "block_sparse_moe.experts.3.w1" if hf_class.startswith("Mixtral") else "mlp.experts.3.gate_proj"
        assert f"model.layers.0.{expert}.weight" in names
        assert not any("gate_up_proj" in n for n in names)


@pytest.mark.parametrize("family", MOE_FAMILIES + ("qwen3",))
def test_import_export_round_trip_is_bit_exact(saved, family, tmp_path):
    """Import then export gives back the Hub layout's files tensor for tensor, from
    either layout; the config says the same model."""
    hf, dirs = saved[family]
    original = stored(dirs[HUB])
    for layout, directory in dirs.items():
        out = tmp_path / layout
        assert cli.main(["import-hf", str(directory), "--out", str(out / "ckpt")]) == 0
        assert cli.main(["export-hf", "--load", str(out / "ckpt"), "--out", str(out / "hf")]) == 0
        exported = stored(out / "hf")
        assert exported.keys() == original.keys(), layout
        for name, value in original.items():
            assert value.dtype == exported[name].dtype and torch.equal(value, exported[name]), (layout, name)
        again = transformers.AutoConfig.from_pretrained(out / "hf")
        width = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
        assert width(again) == width(hf.config)  # Mixtral's null head_dim written as the width it means
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                    "intermediate_size", "rms_norm_eps", "rope_parameters", "router_aux_loss_coef"):
            if hasattr(hf.config, key):
                assert getattr(again, key) == getattr(hf.config, key), (layout, key)


def test_export_is_sharded_with_an_index_and_imports_back(saved, tmp_path):
    hf, dirs = saved["olmoe"]
    assert cli.main(["import-hf", str(dirs[HUB]), "--out", str(tmp_path / "ckpt")]) == 0
    argv = ["export-hf", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--max-shard-size", "40KB"]
    assert cli.main(argv) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    model = gridtrain.load_model(tmp_path / "hf", dtype=torch.float64)
    with torch.no_grad():
        assert relative_difference(model(tokens()), hf(input_ids=tokens()).logits) <= 1e-6


# ---- generation, fine-tuning ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_generate_from_a_hf_dir_gives_transformers_greedy_tokens(saved, family, capsys):
    """gridtrain generate (key/value cache, experts) on the directory samples what
    transformers' own greedy generation does."""
    hf, dirs = saved[family]
    prompt = "The cat sat"
    ids = torch.tensor([ByteTokenizer().encode(prompt)])
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    model = gridtrain.load_model(dirs[HUB], dtype=torch.float64)
    assert torch.equal(generate(model, ids, 10, temperature=0), greedy)
    assert torch.equal(generate(model, ids, 10, temperature=0, use_cache=False), greedy)
    assert cli.main(["generate", "--load", str(dirs[HUB]), "--prompt", prompt, "--max-new-tokens", "4",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith(prompt)


def test_init_from_a_hf_moe_takes_its_shape(saved, tmp_path):
    """--init-from a Qwen3-MoE directory: the run's model is the source's (experts, dense
    layers, head width, norms), a contradicting model flag is refused in one line."""
    from gridtrain.checkpoint.huggingface import check_init_from
    from gridtrain.models.hf_mapping import HFError

    _, dirs = saved["qwen3_moe"]
    cfg = apply_init_from(tiny_config(init_from=str(dirs[FUSED]), seq_len=16), {"seq_len"})
    m = cfg.model
    assert (m.n_experts, m.moe_top_k, m.moe_every, m.attn_head_dim, m.qk_norm, m.seq_len) == (8, 3, 2, 24, "head", 16)
    check_init_from(cfg)
    with pytest.raises(HFError, match="--n-layer 2 .source: 3."):
        apply_init_from(tiny_config(init_from=str(dirs[FUSED])), {"n_layer"})


# ---- what gridtrain cannot express: one line -------------------------------------------------------


@pytest.mark.parametrize("family, changes, words", [
    ("mixtral", dict(sliding_window=8), "sliding_window 8 asks for sliding-window attention"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1 is not supported"),
    ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[]), "put experts in layers [1]"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window True is not supported"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok 9 is not between 1 and the 8 experts"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv 8.0 is not supported"),
    ("olmoe", dict(head_dim=8), "which OLMoE's query/key norms need"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "sliding-window"),
])
def test_variant_gridtrain_lacks_is_one_line(saved, tmp_path, family, changes, words, capsys, no_process_may_start):
    directory = tmp_path / "variant"
    shutil.copytree(saved[family][1][HUB], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    for argv in (["import-hf", str(directory), "--out", str(tmp_path / "ckpt")],
                 ["train", "--init-from", str(directory), "--nproc", "2"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("preset, fields, words", [
    ("moe-tiny", dict(moe_every=2), "dense layers between its MoE layers (--moe-every 2); Mixtral"),
    ("moe-tiny", dict(moe_shared_experts=1), "1 shared experts"),
    ("moe-tiny", dict(moe_norm_topk=False), "Mixtral renormalises its top-k routing weights"),
    ("moe-tiny", dict(qk_norm="full", attn_head_dim=16), "OLMoE's heads are hidden_size / num_attention_heads"),
    ("llama-tiny", dict(qk_norm="full"), "query/key norms over the whole projection"),
    ("tiny", dict(n_experts=4), "a GPT-2 with experts"),
])
def test_export_of_what_no_family_fits_is_one_line(tmp_path, preset, fields, words, capsys):
    _saved_run(tmp_path / "run", preset, fields)
    assert cli.main(["export-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err


# ---- trained on pp 2 x ep 2, then exported --------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_pp2_ep2_run_from_a_hf_moe_exports_to_transformers(saved, family, tmp_path, monkeypatch):
    """transformers' model imported with --init-from, trained two steps on 4 processes
    (dp 2 x pp 2, experts over ep 2: each rank holds half of its stage's experts), saved,
    exported: transformers loads the export with the trained model's logits (read back
    whole with gridtrain.load_model), to 1e-6 as it ships and 1e-12 with its fp32 steps
    made fp64."""
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(saved[family][1][HUB]), "--nproc", "4", "--pp", "2", "--ep", "2",
            "--dtype", "fp64", "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
            "--moe-aux-loss-coeff", "0.01", "--eval-interval", "0", "--sample-tokens", "0", "--no-progress",
            "--save", str(run)]
    assert cli.main(argv) == 0
    trained = gridtrain.load_model(run, dtype=torch.float64)
    initial = gridtrain.load_model(saved[family][1][HUB], dtype=torch.float64)
    moved = max(relative_difference(a.detach(), b.detach()) for (n, a), (_, b)
                in zip(trained.named_parameters(), initial.named_parameters()) if ".experts." in n)
    assert moved > 1e-6  # the experts trained (on their ranks) and came back
    assert cli.main(["export-hf", "--load", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64,
                                                           experts_implementation="eager").eval()
    assert_same_logits(hf, trained, tokens(2, seed=4), monkeypatch)
