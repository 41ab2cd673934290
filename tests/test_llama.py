"""The Llama architecture (--arch llama): its parts as data, its presets' published sizes,
its FLOPs and memory formulas, the dry run's closed forms, and the parity matrix.

The parity matrix (DESIGN.md's invariant: fp64, 1e-9 relative, 10 steps) trains one small
Llama on one process and on every layout the issue names: tp 2 and 4 with the key/value
head count above, equal to and below tp (replicated kv heads), with and without sequence
parallelism; pp 2 and 4 with every schedule; the 3D layouts (2,2,2) (with one kv head,
replicated, and ZeRO-1) and (1,2,4);
recomputation none/selective/full; ZeRO-1. To stay within the suite's time, the cells of
one world size share one spawned world (tests.training.train_layouts): three spawns in all.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gridtrain import dryrun
from gridtrain.models import llama
from gridtrain.memory.model import expected_activation_peak, expected_bytes
from gridtrain.config import ModelConfig, preset_config, set_fields
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.models.decoder import Decoder, block_parameters, count_parameters, init_parameters, training_flops_per_token
from gridtrain.parallel.split_backward import WeightGradStore
from gridtrain.parallel.tensor_parallel import ShardSpec, TensorParallel, shard, shard_spec, unshard
from tests.training import (assert_rank_matches, fake_tp as _fake_tp, relative_difference, saved_bytes_and_formula,
                            train_in_process, train_layouts)

TINY = preset_config("llama-tiny").model


@pytest.fixture(autouse=True)
def one_thread():
    """In-process runs use one thread, as each spawned worker does: two threads on a
    shared 2-core machine spin against each other (tens of times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(cfg: ModelConfig = TINY, **kwargs) -> Decoder:
    model = Decoder(cfg, **kwargs)
    init_parameters(model, 0)
    return model


# ---- the parts, as data --------------------------------------------------------------------------


def test_rotary_turns_each_pair_of_halves_by_its_angle():
    """Hugging Face's convention: dimension i and i + d/2 of a head form one pair, turned
    by position x theta^(-2i/d)."""
    cfg = dataclasses.replace(TINY, seq_len=12, rope_theta=100.0)
    x = torch.randn(2, 3, cfg.seq_len, cfg.head_dim, dtype=torch.float64)
    out = llama.Rotary(cfg).double()(x)
    half = cfg.head_dim // 2
    expected = torch.empty_like(x)
    for pos in range(cfg.seq_len):
        for i in range(half):
            angle = torch.tensor(pos * 100.0 ** (-2 * i / cfg.head_dim), dtype=torch.float32).double()
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., pos, i], x[..., pos, i + half]
            expected[..., pos, i] = a * c - b * s
            expected[..., pos, i + half] = b * c + a * s
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # the tables are fp32, as HF's
    assert torch.equal(out[..., 0, :], x[..., 0, :])  # position 0 is not turned


def test_llama3_rope_scaling_keeps_high_divides_low_and_blends_between():
    """rope_type "llama3" (factor 8, low 1, high 4, original 8192): wavelengths under
    8192/4 kept, over 8192/1 divided by 8, linear in 8192/wavelength between."""
    freqs = torch.tensor([2 * math.pi / 100, 2 * math.pi / 4096, 2 * math.pi / 20000], dtype=torch.float64)
    out = llama.llama3_scaled(freqs, 8.0, 1.0, 4.0, 8192)
    smooth = (8192 / 4096 - 1.0) / (4.0 - 1.0)
    expected = [freqs[0], (1 - smooth) * freqs[1] / 8 + smooth * freqs[1], freqs[2] / 8]
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-15, atol=0)
    cfg = preset_config("llama3-405b").model
    plain = llama.rope_frequencies(dataclasses.replace(cfg, rope_scaling=None))
    scaled = llama.rope_frequencies(cfg)
    assert scaled[0] == plain[0] and torch.allclose(scaled[-1], plain[-1] / 8)
    assert (scaled <= plain).all() and (scaled >= plain / 8).all()


@pytest.mark.parametrize("n_head,n_kv,tp,expected", [
    (8, 2, 1, [[0, 1]]),
    (8, 2, 2, [[0], [1]]),  # kv heads split
    (8, 4, 2, [[0, 1], [2, 3]]),  # more kv heads than tp
    (8, 2, 4, [[0], [0], [1], [1]]),  # tp exceeds them: each replicated on 2 ranks
    (8, 2, 8, [[0]] * 4 + [[1]] * 4),
    (32, 8, 16, [[r // 2] for r in range(16)]),  # llama3-8b at tp 16
    (9, 3, 3, [[0], [1], [2]]),  # smollm2
])
def test_kv_heads_of_each_tp_rank(n_head, n_kv, tp, expected):
    """A rank holds exactly the kv heads its query heads read, and its shard of a k/v
    weight (ShardSpec with replicas) holds exactly those heads' rows."""
    assert [list(llama.kv_heads_of_rank(n_head, n_kv, tp, r)) for r in range(tp)] == expected
    replicas = llama.kv_replicas(n_kv, tp)
    full = torch.arange(n_kv, dtype=torch.float64).repeat_interleave(4).unsqueeze(1)  # 4 rows per head
    spec = ShardSpec(0, replicas=replicas)
    shards = [shard(full, spec, r, tp) for r in range(tp)]
    for r in range(tp):
        assert shards[r][::4, 0].tolist() == expected[r]
        groups = {q * n_kv // n_head for q in llama.query_heads_of_rank(n_head, tp, r)}
        assert groups == set(expected[r])
    assert spec.full_shape(shards[0].shape, tp) == tuple(full.shape)
    torch.testing.assert_close(unshard(shards, spec), full, rtol=0, atol=0)


def test_tp_shapes_with_replicated_kv_heads():
    """tp 4 over 8 query heads and 2 kv heads: 2 query heads per rank, 1 kv head each,
    gate and up sharded separately; the global tensors do not depend on tp."""
    h, f, hd = TINY.d_model, TINY.ffn_size, TINY.head_dim
    block = Decoder(TINY, tp=_fake_tp(4, 3)).blocks["0"]
    assert block.attn.q.weight.shape == (2 * hd, h) and block.attn.k.weight.shape == (hd, h)
    assert shard_spec(block.attn.k.weight) == ShardSpec(0, replicas=2)
    assert block.mlp.gate.weight.shape == block.mlp.up.weight.shape == (f // 4, h)
    assert block.mlp.down.weight.shape == (h, f // 4) and block.attn.proj.bias is None
    whole = dict(build().named_parameters())
    for tp in (2, 4):
        parts = [dict(build(tp=_fake_tp(tp, r)).named_parameters()) for r in range(tp)]
        for name in ("blocks.0.attn.k.weight", "blocks.0.mlp.gate.weight", "blocks.0.mlp.up.weight"):
            spec = shard_spec(parts[0][name])
            torch.testing.assert_close(unshard([p[name] for p in parts], spec), whole[name], rtol=0, atol=0)


def test_rms_norm_gradients_match_autograd_of_the_formula():
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: llama._RMSNorm.apply(a, b, 1e-5), (x, w))
    y = llama._RMSNorm.apply(x, w, 1e-5)
    torch.testing.assert_close(y, w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_split_backward_gives_the_plain_gradients():
    """ZB-H1's B (input gradients; q, k, v, proj, gate, up, down and head weights queued)
    then W equals one plain backward."""
    store = WeightGradStore()
    plain, split = build().double(), build(tp=TensorParallel(weight_grads=store)).double()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    plain(tokens, tokens).sum().backward()
    with store.defer("mb0"):
        split(tokens, tokens).sum().backward()
    deferred = {n for n, p in split.named_parameters() if p.grad is None}
    assert {"blocks.0.attn.k.weight", "blocks.0.mlp.up.weight", "head"} <= deferred
    assert "blocks.0.ln1.weight" not in deferred
    store.flush("mb0")
    for (name, a), (_, b) in zip(plain.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_matches_hugging_face_llama():
    """Same weights, same logits as transformers' LlamaForCausalLM, grouped-query
    attention and Llama 3's rope scaling included (HF normalises in fp32: 1e-6)."""
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(TINY, vocab_pad_multiple=1, rope_theta=500000.0, rope_scaling="llama3",
                              rope_original_max_positions=16)
    ours = build(cfg).double()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.layernorm_eps, tie_word_embeddings=False,
        rope_theta=cfg.rope_theta, attn_implementation="sdpa",
        rope_scaling={"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                      "high_freq_factor": cfg.rope_high_freq_factor, "rope_theta": cfg.rope_theta,
                      "original_max_position_embeddings": cfg.rope_original_max_positions})).double()
    hf_names = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "attn.q": "self_attn.q_proj",
                "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.proj": "self_attn.o_proj",
                "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    state = {"model.embed_tokens.weight": ours.embedding.word.weight, "model.norm.weight": ours.final_norm.weight,
             "lm_head.weight": ours.head}
    for name, p in ours.blocks.named_parameters():
        i, module = name.split(".", 1)[0], name.split(".", 1)[1].rsplit(".", 1)[0]
        state[f"model.layers.{i}.{hf_names[module]}.weight"] = p
    hf.load_state_dict(state, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        assert relative_difference(ours(tokens).numpy(), hf(tokens).logits.numpy()) < 1e-6


# ---- sizes, FLOPs, memory ---------------------------------------------------------------------------

PUBLISHED = {  # parameters of the published checkpoints (embedding and untied head included)
    "smollm2-135m": 134_515_008,
    "tinyllama-1.1b": 1_100_048_384,
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_have_the_published_sizes(name):
    assert count_parameters(preset_config(name).model) == PUBLISHED[name]


def test_parameter_formula_counts_the_module_at_every_tp():
    model = Decoder(TINY)
    padding = 2 * (model.padded_vocab - TINY.vocab_size) * TINY.d_model  # token table and untied head
    assert sum(p.numel() for p in model.parameters()) - padding == count_parameters(TINY)
    for tp in (2, 4, 8):
        for rank in range(tp):
            blocks = Decoder(TINY, tp=_fake_tp(tp, rank)).blocks
            assert sum(p.numel() for p in blocks.parameters()) == TINY.n_layer * block_parameters(TINY, tp)


def test_flops_formula_matches_counted_flops():
    """Per token: 3 x (every matmul of forward) + the logits, as torch's FLOP counter
    sees a forward and backward with the op-by-op attention (kv heads repeated inside
    the core count as the query heads they serve)."""
    cfg = dataclasses.replace(TINY, seq_len=32, vocab_size=256, vocab_pad_multiple=1, attention="math")
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).sum().backward()
    assert counter.get_total_flops() / tokens.numel() == pytest.approx(training_flops_per_token(cfg), rel=1e-9)
    d, f, kv = 4096, 14336, 1024  # llama3-8b: the 6N rule within 10% at its 8K context
    assert training_flops_per_token(preset_config("llama3-8b").model) == pytest.approx(
        3 * (32 * (2 * d * (2 * d + 2 * kv) + 6 * d * f + 4 * 8192 * d) + 2 * d * 128256))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_saved_bytes_follow_the_formula(recompute):
    """One process, op-by-op attention, dropout 0.1: the meter's bytes per block are the
    formula's (memory.activations.korthikanti_bytes for llama) within 0.5% (the norms' per-token
    statistics are left out of it)."""
    cfg = dataclasses.replace(TINY, attention="math", dropout=0.1, n_kv_head=2)
    measured, expected = saved_bytes_and_formula(cfg, recompute)
    for i in range(cfg.n_layer):
        assert measured[f"blocks.{i}"] == pytest.approx(expected, rel=0.005)


def test_checkpoints_compare_the_architecture_and_resolved_kv_heads():
    from gridtrain.checkpoint import CheckpointError, compare_models

    llama_cfg = preset_config("llama-tiny").model
    with pytest.raises(CheckpointError, match="arch 'llama' .checkpoint. vs 'gpt2'.*--arch llama"):
        compare_models(llama_cfg, dataclasses.replace(llama_cfg, arch="gpt2"), "--load x")
    mha = dataclasses.replace(llama_cfg, n_kv_head=None)
    compare_models(mha, dataclasses.replace(llama_cfg, n_kv_head=8), "--load x")  # None means n_head
    with pytest.raises(CheckpointError, match="--n-kv-head 2"):
        compare_models(llama_cfg, mha, "--load x")


# ---- the dry run ----------------------------------------------------------------------------------


def _dry_cfg(preset="llama-tiny", **changes):
    cfg = preset_config(preset)
    cfg.training.device = "cpu"
    return set_fields(cfg, **changes)


DRY = {  # world, ranks to run (the replicated kv-head copies among them), changes
    "tp4-replicated-kv-sp-zero": (16, "0,1,10", dict(tp=4, pp=2, sequence_parallel=True, zero=1, n_layer=4)),
    "tp2-selective-bf16": (4, "0,3", dict(tp=2, pp=2, dtype="bf16", recompute="selective", n_layer=4)),
    "tp8-full-interleaved": (16, "5,13", dict(tp=8, pp=2, vpp=2, schedule="interleaved-1f1b", recompute="full",
                                              n_layer=4)),
    "smollm2-tied-zb": (8, "edges", dict(preset="smollm2-135m", pp=4, schedule="zb-h1", n_layer=4, seq_len=64,
                                         micro_batch_size=1, global_batch_size=8)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", DRY)
def test_dry_run_bytes_and_peak_follow_the_closed_forms(case):
    """Ranks of small Llama layouts (replicated kv heads, SP, ZeRO-1, tied SmolLM2):
    parameter, gradient and optimizer bytes equal the closed forms, the activation peak
    is within 5% of the formula walked along the schedule."""
    world, ranks, changes = DRY[case]
    changes = dict(changes)
    cfg = _dry_cfg(changes.pop("preset", "llama-tiny"), attention="math", dropout=0.1, **changes)
    grid = ProcessGrid.build(world, tp=cfg.parallel.tp, pp=cfg.parallel.pp)
    report = dryrun.dry_run(cfg, world, ranks, out=lambda *_: None)
    for r in report["ranks"]:
        expected = expected_bytes(cfg, grid, r["rank"])
        assert {k: r[k] for k in expected} == expected, r["rank"]
        formula = expected_activation_peak(cfg, grid, r["rank"], "cpu")
        assert r["activation_peak_bytes"] == pytest.approx(formula, rel=0.05), r


# ---- parity with one process (real gloo processes) ------------------------------------------------

SEQ = 32
STEPS, HALF = 6, 3  # parity runs; the world of 4 saves after HALF steps and resumes


def _config(n_kv_head: int = 2, n_layer: int = 4, **changes):
    """llama-tiny with ``n_layer`` blocks of 32 tokens, the parity recipe (fp64, 6 steps,
    4 micro-batches of 2, no dropout) and ``changes`` to any section."""
    cfg = preset_config("llama-tiny")
    cfg.model.n_layer, cfg.model.seq_len, cfg.model.n_kv_head = n_layer, SEQ, n_kv_head
    set_fields(cfg, dtype="fp64", steps=STEPS, global_batch_size=8, micro_batch_size=2, eval_interval=0, eval_iters=1,
               progress=False, lr=3e-3, warmup_steps=2, **changes)
    return cfg


_references: dict[tuple[int, int], dict] = {}


def _reference(cfg) -> dict:
    """The one-process run of ``cfg``'s model (cached: many layouts compare to it)."""
    key = (cfg.model.kv_heads, cfg.model.n_layer)
    if key not in _references:
        _references[key] = train_in_process(_config(*key))
    return _references[key]


# (n_kv_head, changes) per cell; one spawned world per world size runs its cells in turn
CELLS = {
    2: [(2, dict(tp=2)),  # kv heads = tp: one each
        (4, dict(tp=2, sequence_parallel=True, recompute="selective")),  # kv heads > tp
        (2, dict(pp=2, schedule="gpipe", recompute="full")),
        (2, dict(pp=2, schedule="1f1b")),
        (2, dict(pp=2, vpp=2, schedule="interleaved-1f1b", recompute="selective")),
        (2, dict(pp=2, schedule="zb-h1")),
        (2, dict(dp=2, zero=1))],
    4: [(2, dict(tp=4)),  # kv heads < tp: each replicated on 2 ranks
        (2, dict(tp=4, sequence_parallel=True, recompute="full", attention="math")),
        (4, dict(tp=4, sequence_parallel=True)),
        (2, dict(pp=4, schedule="gpipe")),
        (2, dict(pp=4, schedule="1f1b", recompute="selective")),
        (2, dict(pp=4, vpp=2, schedule="interleaved-1f1b", n_layer=8)),  # 8 blocks: 4 stages x 2 chunks
        (2, dict(pp=4, schedule="zb-h1", recompute="full"))],
    8: [(1, dict(dp=2, pp=2, tp=2, sequence_parallel=True, zero=1)),  # one kv head (MQA) on both TP ranks
        (2, dict(pp=2, tp=4, sequence_parallel=True, schedule="zb-h1", recompute="selective"))],
}


def expected_tp_bytes(cfg) -> dict[str, int]:
    """TP payload of one step of a TP-only layout (fp64), as tests/test_tensor_parallel.py
    counts GPT-2's: the same activation traffic (q, k, v enter the TP region once, and so
    do gate and up), Llama's sequence-parallel sums (two RMSNorm weights a block and the
    final norm; no biases, no position table), and, when tp exceeds the kv heads, the
    sum of the replicated k and v gradients: one [kv heads, local numel] buffer each.
    Full recomputation runs each block's forward collectives again in backward."""
    m, t, tp = cfg.model, cfg.training, cfg.parallel.tp
    b, s, h, L, e = t.micro_batch_size, m.seq_len, m.d_model, m.n_layer, 8
    n_micro = t.global_batch_size // b
    activation = (2 * L + 1) * b * s * h * e
    again = 2 * L * b * s * h * e if cfg.activations.recompute == "full" else 0
    ce = 3 * b * s * e
    replicated = L * 2 * m.kv_heads * m.head_dim * h * e if tp > m.kv_heads else 0
    out = {"broadcast/tp": n_micro * 2 * b * s * 8}
    if cfg.parallel.sequence_parallel:
        out["all_gather/tp"] = n_micro * (3 * activation + again)
        out["reduce_scatter/tp"] = n_micro * (2 * activation + again)
        out["all_reduce/tp"] = n_micro * ce + (2 * L + 1) * h * e + replicated
    else:
        out["all_reduce/tp"] = n_micro * (2 * activation + again + ce) + replicated
    return out


@pytest.mark.spawn
@pytest.mark.parametrize("world", sorted(CELLS))
def test_every_layout_trains_the_single_process_model(world, tmp_path):
    """DESIGN.md invariant for --arch llama, cell by cell of one spawned world: every
    rank's losses, grad norms and weights (its TP shards) within 1e-9 of one process,
    and together the ranks hold every weight. In the world of 4, checkpoints (whole
    tensors) move both ways between one process and tp 4 with replicated kv heads."""
    cfgs = [_config(kv, **changes) for kv, changes in CELLS[world]]
    if world == 4:
        cfgs[0].checkpoint.save, cfgs[0].checkpoint.save_interval = str(tmp_path / "tp4"), HALF
        one = _config(2, save=str(tmp_path / "one"), save_interval=HALF)
        train_in_process(one)
        cfgs.append(_config(2, tp=4, load=str(tmp_path / "one" / f"step_{HALF:07d}")))
    results = train_layouts(cfgs, world, timeout_s=600)
    for cfg, runs in zip(cfgs, results):
        reference = _reference(cfg)
        if cfg.checkpoint.load is not None:  # resumed after step 5
            reference = dict(reference, losses=reference["losses"][HALF:], grad_norms=reference["grad_norms"][HALF:])
        for rank, run in enumerate(runs):
            try:
                assert_rank_matches(run, reference, cfg, rank % cfg.parallel.tp)
            except AssertionError as e:
                raise AssertionError(f"{cfg.parallel} rank {rank}: {e}") from None
        assert set().union(*(r["state"].keys() for r in runs)) == reference["state"].keys()
        if cfg.parallel.tp == world:  # TP only: the bytes each step moves, exactly
            for step_bytes in runs[0]["step_bytes"]:
                assert {k: v for k, v in step_bytes.items() if k.endswith("/tp")} == expected_tp_bytes(cfg)
    if world == 4:
        resumed = train_in_process(_config(2, load=str(tmp_path / "tp4" / f"step_{HALF:07d}")))
        assert relative_difference(resumed["losses"], _reference(cfgs[0])["losses"][HALF:]) <= 1e-9
