"""Activation recomputation and memory accounting: same gradients and dropout masks as
without recomputation, regions chosen as the policy says, saved bytes counted against
the formula of Korthikanti et al., and parity on real gloo processes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gridtrain.memory import activations as memory
from gridtrain.parallel import recompute
from gridtrain.config import ConfigError, load_config, preset_config
from gridtrain.training.validate import validate
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.parallel.recompute import Recomputation, RecomputePolicy
from gridtrain.parallel.rng import RNGStatesTracker
from gridtrain.parallel.tensor_parallel import TensorParallel
from gridtrain.runtime.activation_meter import ActivationMeter, SavedActivations
from tests.training import relative_difference, tiny_config, train_in_process, train_layouts


def _model(mode: str = "none", *, dropout: float = 0.1, attention: str = "math", **policy) -> Decoder:
    cfg = preset_config("tiny").model
    cfg.dropout, cfg.attention = dropout, attention
    rng = RNGStatesTracker(torch.device("cpu"))
    rng.add("model-parallel", 77)  # a TP stream, as every distributed run has
    model = Decoder(cfg, tp=TensorParallel(rng=rng), recompute=Recomputation(RecomputePolicy(mode, **policy), rng))
    init_parameters(model, 0)
    return model.double()


def _step(model: Decoder, tokens: torch.Tensor, meter: ActivationMeter | None = None):
    """One forward and backward from a fixed generator state; loss, grads, meter."""
    torch.manual_seed(5)
    meter = meter or ActivationMeter.for_model(model)
    with SavedActivations(meter):
        loss = model(tokens, tokens).mean()
        loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], meter


TOKENS = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize("mode,policy", [("selective", {}), ("full", {}), ("full", {"layers": 2}),
                                         ("full", {"method": "block", "layers": 1})])
def test_recomputation_gives_the_same_loss_and_gradients_with_dropout(attention, mode, policy):
    loss, grads, _ = _step(_model(attention=attention), TOKENS)
    model = _model(mode, attention=attention, **policy)
    loss_r, grads_r, _ = _step(model, TOKENS)
    assert loss_r == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))
    regions = {"selective": 2, "full": 2 if policy.get("layers", 1) == 1 and "method" not in policy else 1}
    assert model.recompute.recomputed == regions[mode]


def test_without_rng_replay_the_masks_differ(monkeypatch):
    """The test above can fail: recomputing without restoring the generators draws new
    dropout masks and the gradients change."""
    _, grads, _ = _step(_model(), TOKENS)
    monkeypatch.setattr(recompute, "replaying", lambda *args: contextlib.nullcontext())
    _, grads_r, _ = _step(_model("full"), TOKENS)
    assert not all(torch.equal(a, b) for a, b in zip(grads, grads_r))


def test_without_the_tensor_parallel_stream_the_attention_masks_differ(monkeypatch):
    """Attention dropout draws from the TP tracker's stream: replaying only the CPU
    generator is not enough."""
    _, grads, _ = _step(_model(), TOKENS)
    capture = recompute.RNGState.capture
    monkeypatch.setattr(recompute.RNGState, "capture",
                        classmethod(lambda cls, tracker, device: capture(None, device)))
    _, grads_r, _ = _step(_model("selective"), TOKENS)
    assert not all(torch.equal(a, b) for a, b in zip(grads, grads_r))


def test_recomputation_leaves_the_random_streams_where_they_were():
    """After a step, the CPU generator and the TP stream are where a step without
    recomputation leaves them: the next step's masks do not depend on the mode."""
    states = []
    for mode in ("none", "full"):
        model = _model(mode)
        _step(model, TOKENS)
        states.append((torch.get_rng_state(), model.tp.rng.get_states()["model-parallel"]))
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])


def test_block_runs_follow_megatrons_methods():
    ids = (4, 5, 6, 7, 8)
    assert RecomputePolicy("none").block_runs(ids) == [(ids, False)]
    assert RecomputePolicy("selective").block_runs(ids) == [(ids, False)]
    assert RecomputePolicy("full").block_runs(ids) == [((i,), True) for i in ids]
    assert RecomputePolicy("full", "uniform", 2).block_runs(ids) == [((4, 5), True), ((6, 7), True), ((8,), True)]
    assert RecomputePolicy("full", "block", 2).block_runs(ids) == [((4,), True), ((5,), True), ((6, 7, 8), False)]
    assert RecomputePolicy("full", "block", 9).block_runs(ids) == [((i,), True) for i in ids]
    assert RecomputePolicy("full").block_runs(()) == []


# ---- counted bytes against the formula ----------------------------------------------------------

def _shape(model: Decoder, batch: int, dropout: bool, element_bytes: int) -> dict:
    c = model.cfg
    return dict(seq=c.seq_len, batch=batch, hidden=c.d_model, heads=c.n_head, ffn=c.ffn_size,
                element_bytes=element_bytes, mask_bytes=memory.dropout_mask_bytes("cpu", element_bytes),
                dropout=dropout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_saved_bytes_per_layer_match_the_adapted_formula(mode, dropout, dtype):
    """Counted, not timed: each block's bytes saved for backward are within 10% of
    Korthikanti et al.'s count adapted to the dtype, CPU dropout masks and this model
    (the only thing the formula leaves out is LayerNorm's mean and 1/std per token)."""
    model = _model(mode, dropout=dropout).to(dtype)
    _, _, meter = _step(model, TOKENS)
    e = torch.finfo(dtype).bits // 8
    expected = memory.korthikanti_bytes(recompute=mode, **_shape(model, 2, dropout > 0, e))
    for layer in ("blocks.0", "blocks.1"):
        measured = meter.by_layer()[layer]
        assert abs(measured - expected) <= 0.10 * expected, (layer, measured, expected)
    if mode == "full":
        assert measured == expected  # exactly the block's input
    assert meter.live_bytes == 0  # everything was released by backward


def test_formula_reduces_to_the_papers_16_bit_numbers():
    shape = dict(seq=2048, batch=1, hidden=12288, heads=96, ffn=4 * 12288, element_bytes=2, mask_bytes=1)
    s, b, h, a = 2048, 1, 12288, 96
    assert memory.korthikanti_bytes(**shape) == s * b * h * (34 + 5 * a * s / h)
    assert memory.korthikanti_bytes(tp=8, **shape) == pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert memory.korthikanti_bytes(tp=8, recompute="selective", **shape) == pytest.approx(s * b * h * (10 + 24 / 8))
    assert memory.korthikanti_bytes(recompute="full", **shape) == 2 * s * b * h


@pytest.mark.slow
def test_recomputation_lowers_the_peak_of_saved_bytes():
    peaks = {mode: _step(_model(mode), TOKENS)[2].peak_bytes for mode in ("none", "selective", "full")}
    assert peaks["full"] < peaks["selective"] < peaks["none"]


# ---- in a training run ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_keep_last_recomputes_every_micro_batch_but_the_last():
    """Bit-exact against the same model without recomputation: like with like, the same
    attention kernel on both sides (the fused and the op-by-op kernels differ in the last
    bit of fp64 on some CPUs)."""
    cfg = tiny_config(recompute="full", recompute_keep_last=True, steps=1, global_batch_size=8, micro_batch_size=2)
    cfg.model.attention = "math"  # the memory formula counts the op-by-op kernel
    run = train_in_process(cfg)
    reference = tiny_config(steps=1, global_batch_size=8, micro_batch_size=2)
    reference.model.attention = "math"
    reference = train_in_process(reference)
    assert run["losses"] == reference["losses"]
    assert run["recomputed"] == 3 * cfg.model.n_layer  # 4 micro-batches, the last one kept
    stage = run["memory"][0]
    for layer, expected in stage.expected.items():
        assert abs(stage.per_micro_batch(layer) - expected) <= 0.10 * expected


@pytest.mark.spawn
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_dropout_masks_are_replayed_under_tensor_and_pipeline_parallelism(schedule):
    """With dropout 0.1 on pp 2 x tp 2 with sequence parallelism (TP streams in attention
    and in every dropout), recomputation does not change a single bit of any loss, with
    a plain or a split (ZB) backward."""
    cfgs = []
    for mode in ("none", "selective", "full"):
        cfg = tiny_config(recompute=mode, steps=4)
        cfg.model.dropout = 0.1
        cfg.parallel.tp = cfg.parallel.pp = 2
        cfg.parallel.sequence_parallel, cfg.parallel.schedule = True, schedule
        cfgs.append(cfg)
    plain, *recomputed = train_layouts(cfgs, 4)
    for runs in recomputed:
        for a, b in zip(plain, runs):
            assert b["recomputed"] > 0 and a["recomputed"] == 0
            assert a["losses"] == b["losses"]
            assert relative_difference(a["grad_norms"], b["grad_norms"]) <= 1e-12


@pytest.mark.spawn
def test_early_recomputation_rebuilds_before_the_gradient_arrives():
    """pp 2: a stage rebuilds each micro-batch's recomputed regions while its gradient is
    in flight, under every schedule, with and without keeping the last micro-batch; the
    model is the one process's."""
    cases = [("1f1b", 1, False), ("gpipe", 1, True), ("interleaved-1f1b", 2, False), ("zb-h1", 1, False)]
    cfgs = []
    for schedule, vpp, keep_last in cases:
        cfg = tiny_config(recompute="full", recompute_early=True, recompute_keep_last=keep_last, steps=3)
        cfg.model.n_layer = 4
        cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.schedule = 2, vpp, schedule
        cfgs.append(cfg)
    reference_cfg = tiny_config(steps=3)
    reference_cfg.model.n_layer = 4
    reference = train_in_process(reference_cfg)
    for (schedule, vpp, keep_last), runs in zip(cases, train_layouts(cfgs, 2)):
        for run in runs:
            assert relative_difference(run["losses"], reference["losses"]) <= 1e-9, schedule
        # 3 steps x micro-batches recomputed (the last kept or not) x the stage's 2 blocks
        micro_batches = 4 - keep_last
        assert runs[0]["rebuilt_early"] == 3 * micro_batches * 2, schedule
        # the last stage receives gradients only for its first chunk (interleaved)
        assert runs[1]["rebuilt_early"] == (3 * micro_batches * 1 if vpp == 2 else 0), schedule
        assert runs[0]["recomputed"] == runs[0]["rebuilt_early"]


@pytest.mark.spawn
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_saved_bytes_under_tensor_parallelism_match_the_formula(sequence_parallel):
    """The TP form of the formula, sbh(10 + 24/t + 5as/(ht)) adapted, per block of each
    TP rank, in every mode (measured in a training run, as --memory-report shows it)."""
    cfgs = []
    for mode in ("none", "selective", "full"):
        cfg = tiny_config(recompute=mode, steps=1)
        cfg.model.attention, cfg.model.dropout = "math", 0.1
        cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, sequence_parallel
        cfgs.append(cfg)
    for mode, runs in zip(("none", "selective", "full"), train_layouts(cfgs, 2)):
        for run in runs:
            stage = run["memory"][0]
            assert stage.expected.keys() == {"blocks.0", "blocks.1"}
            for layer, expected in stage.expected.items():
                measured = stage.per_micro_batch(layer)
                assert abs(measured - expected) <= 0.10 * expected, (mode, layer, measured, expected)


@pytest.mark.spawn
def test_pipeline_stage_peak_is_micro_batches_in_flight_times_their_bytes():
    """GPipe keeps all m micro-batches' activations on a stage, 1F1B at most p - s."""
    cfgs = []
    for schedule in ("gpipe", "1f1b"):
        cfg = tiny_config(steps=1)
        cfg.model.attention = "math"
        cfg.parallel.pp, cfg.parallel.schedule = 2, schedule
        cfgs.append(cfg)
    gpipe, one_f_one_b = train_layouts(cfgs, 2)
    for runs, held in ((gpipe, [4, 4]), (one_f_one_b, [2, 1])):
        for stage in runs[0]["memory"]:
            per_micro_batch = sum(stage.kept.values()) / stage.micro_batches
            assert stage.peak_bytes == held[stage.stage] * per_micro_batch, stage.stage


@pytest.mark.slow
def test_offload_on_cpu_says_it_does_nothing(capsys):
    cfg = tiny_config(offload_activations=True, steps=2)
    run = train_in_process(cfg)
    assert "nothing to offload" in capsys.readouterr().out
    assert run["losses"] == train_in_process(tiny_config(steps=2))["losses"]


@pytest.mark.parametrize("training,message", [
    ({"recompute": "sometimes"}, "--recompute 'sometimes' is not one of"),
    ({"recompute": "selective", "recompute_layers": 2}, "choose blocks for --recompute full"),
    ({"recompute": "full", "recompute_method": "zigzag"}, "--recompute-method 'zigzag'"),
    ({"recompute": "full", "recompute_layers": 0}, "--recompute-layers must be >= 1"),
    ({"recompute_keep_last": True}, "--recompute-keep-last needs recomputation"),
    ({"recompute": "full", "recompute_early": True}, "--recompute-early .* needs --pp > 1"),
])
def test_bad_recompute_settings_fail_before_anything_starts(training, message):
    cfg = load_config(None, {"training": training})
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=1)


def test_the_recompute_anchor_lives_on_the_inputs_device(monkeypatch):
    """A region's anchor (what makes its outputs require grad) is created beside its
    inputs: a CPU anchor in a CUDA region would give the backward node mixed devices."""
    seen = []
    monkeypatch.setattr(recompute._Checkpoint, "apply", lambda region, anchor, *inputs: seen.append(anchor.device))
    rc = Recomputation(RecomputePolicy("full"))
    rc.checkpoint(lambda t: t * 2, torch.ones(2, device="meta", requires_grad=True))
    rc.checkpoint(lambda: torch.ones(1))  # no tensor input: the rank's device
    assert seen == [torch.device("meta"), torch.device("cpu")]
