"""Resharding: a checkpoint written by one layout continues on another exactly.

Each case saves after step 3 of 6 on layout A and resumes on layout B; B's steps 4-6
(losses, gradient norms, validation loss, and the weights of its final checkpoint
loaded whole into one process) must equal an uninterrupted one-process run
within 1e-9 (fp64). The pairs cover tp 1<->2<->4, pp 1<->2<->4, vpp 2, dp 1<->4,
ZeRO-1 on<->off, SP on<->off, and both architectures (Llama at tp 4 replicates its two
key/value heads). Every multi-rank run has 4 ranks, and all of them, A runs first, share
one spawn; one-rank runs train in this process.
"""

from __future__ import annotations

import dataclasses

import pytest

from gridtrain import checkpoint
from gridtrain.config import Config, preset_config
from gridtrain.models.decoder import Decoder, count_parameters, init_parameters
from tests.test_checkpoint_shards import stored_bytes_by_file
from tests.training import relative_difference, tiny_config, train_in_process, train_layouts

STEPS, SAVE_STEP = 6, 3
ONE = {}  # one process

# (name, model, layout A, layout B); every layout of 4 ranks or of one
PAIRS = [
    ("gpt-1-to-pp4", "tiny", ONE, dict(pp=4)),
    ("gpt-tp2-dp2-zero-sp-to-1", "tiny", dict(tp=2, dp=2, zero=1, sequence_parallel=True), ONE),
    ("gpt-tp2-pp2-to-tp4", "tiny", dict(tp=2, pp=2), dict(tp=4)),
    ("gpt-pp4-to-tp2-dp2-zero-sp", "tiny", dict(pp=4), dict(tp=2, dp=2, zero=1, sequence_parallel=True)),
    ("gpt-pp2-vpp2-dp2-to-dp4-zero", "tiny", dict(pp=2, vpp=2, dp=2), dict(dp=4, zero=1)),
    ("llama-tp4-to-tp2-pp2-sp", "llama-tiny", dict(tp=4), dict(tp=2, pp=2, sequence_parallel=True)),
    ("llama-dp4-zero-to-tp2-pp2-vpp2", "llama-tiny", dict(dp=4, zero=1), dict(tp=2, pp=2, vpp=2)),
    ("llama-tp2-pp2-sp-to-1", "llama-tiny", dict(tp=2, pp=2, sequence_parallel=True), ONE),
    ("llama-1-to-dp4-zero", "llama-tiny", ONE, dict(dp=4, zero=1)),
]


def _config(model: str, layout: dict, *, save: str | None = None, load: str | None = None) -> Config:
    cfg = tiny_config(steps=STEPS)
    cfg.model = dataclasses.replace(preset_config(model).model, n_layer=4)  # 4 layers: pp 4, pp 2 x vpp 2
    layout = dict(layout)
    cfg.parallel.zero = layout.pop("zero", 0)
    schedule = "interleaved-1f1b" if layout.get("vpp", 1) > 1 else cfg.parallel.schedule
    cfg.parallel = dataclasses.replace(cfg.parallel, schedule=schedule, **layout)
    cfg.checkpoint.save, cfg.checkpoint.load = save, load
    cfg.checkpoint.save_interval = SAVE_STEP if save and not load else 0  # B saves only at the end
    return cfg


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Per pair: the reference, A's run and B's resumed run (rank 0's summaries)."""
    root = tmp_path_factory.mktemp("reshard")
    refs = {model: train_in_process(_config(model, ONE)) for model in {m for _, m, _, _ in PAIRS}}
    saves = {name: str(root / name) for name, *_ in PAIRS}
    a_cfgs = {name: _config(model, a, save=saves[name]) for name, model, a, _ in PAIRS}
    b_cfgs = {name: _config(model, b, load=str(checkpoint.step_dir(saves[name], SAVE_STEP)),
                            save=saves[name] + "-b") for name, model, _, b in PAIRS}
    runs: dict[str, dict] = {}
    for name, _, a, _ in PAIRS:
        if a is ONE:
            runs[name + "/a"] = train_in_process(a_cfgs[name])
    spawned = [(name + "/a", a_cfgs[name]) for name, _, a, _ in PAIRS if a is not ONE] + \
              [(name + "/b", b_cfgs[name]) for name, _, _, b in PAIRS if b is not ONE]
    results = train_layouts([cfg for _, cfg in spawned], 4, timeout_s=900)
    for (key, _), per_rank in zip(spawned, results):
        runs[key] = per_rank[0]
    for name, _, _, b in PAIRS:
        if b is ONE:
            runs[name + "/b"] = train_in_process(b_cfgs[name])
    for name, *_ in PAIRS:
        runs[name + "/b"]["save"] = saves[name] + "-b"
    return refs, runs, saves


def _save_dirs(resharded) -> dict[str, str]:
    return resharded[2]


def _final_weights(save_dir: str, model: str) -> dict:
    """The weights of a run's last checkpoint, loaded whole into one process."""
    cfg = _config(model, ONE)
    gpt = Decoder(cfg.model)
    init_parameters(gpt, 0)  # vocabulary padding rows zero, as in the reference
    gpt.double()
    assert checkpoint.load_checkpoint(save_dir, gpt) == STEPS
    return {k: v.numpy() for k, v in gpt.state_dict().items()}


@pytest.mark.spawn
@pytest.mark.parametrize("name,model", [(name, model) for name, model, _, _ in PAIRS])
def test_a_checkpoint_continues_exactly_on_another_layout(resharded, tmp_path_factory, name, model):
    refs, runs, _ = resharded
    reference = refs[model]
    for key in ("losses", "grad_norms"):  # A trains the same model, B continues it
        assert relative_difference(runs[name + "/a"][key], reference[key]) <= 1e-9, key
        assert len(runs[name + "/b"][key]) == STEPS - SAVE_STEP
        assert relative_difference(runs[name + "/b"][key], reference[key][SAVE_STEP:]) <= 1e-9, key
    assert abs(runs[name + "/b"]["valid_loss"] - reference["valid_loss"]) <= 1e-9 * reference["valid_loss"]
    weights = _final_weights(runs[name + "/b"]["save"], model)
    assert weights.keys() == reference["state"].keys()
    for key, value in weights.items():
        assert relative_difference(value, reference["state"][key]) <= 1e-9, key


def test_the_pairs_cover_every_transition_the_issue_names():
    """tp 1<->2<->4, pp 1<->2<->4, vpp 2, dp 1<->4, ZeRO and SP both ways, both architectures."""
    def get(layout, key, default=1):
        return layout.get(key, default)
    moves = {(k, get(a, k, d), get(b, k, d)) for _, _, a, b in PAIRS
             for k, d in (("tp", 1), ("pp", 1), ("dp", 1), ("vpp", 1), ("zero", 0), ("sequence_parallel", False))}
    for k, x, y in [("tp", 1, 2), ("tp", 2, 1), ("tp", 2, 4), ("tp", 4, 2), ("pp", 1, 2), ("pp", 2, 1),
                    ("pp", 1, 4), ("pp", 4, 1), ("dp", 1, 4), ("dp", 4, 1), ("vpp", 1, 2), ("vpp", 2, 1),
                    ("zero", 0, 1), ("zero", 1, 0), ("sequence_parallel", False, True),
                    ("sequence_parallel", True, False)]:
        assert (k, x, y) in moves, (k, x, y)
    assert {m for _, m, _, _ in PAIRS} == {"tiny", "llama-tiny"}


@pytest.mark.spawn
@pytest.mark.parametrize("name,model", [(name, model) for name, model, a, _ in PAIRS if a is not ONE])
def test_every_rank_writes_its_own_pieces_and_every_element_is_stored_once(resharded, name, model):
    """Counted from DCP's index of A's checkpoint: each tensor's chunks tile it exactly
    (replicas written once), the weights and the two Adam moments total the model's
    parameters x 8 bytes each (fp64: no separate masters), and every rank wrote a file."""
    step = checkpoint.step_dir(_save_dirs(resharded)[name], SAVE_STEP)
    per_file, per_kind = stored_bytes_by_file(step)
    n = count_parameters(_config(model, ONE).model)
    assert per_kind == {"model": 8 * n, "optim": 2 * 8 * n}
    assert sum(per_file.values()) == 3 * 8 * n
    assert sorted(per_file) == [f"__{r}_0.distcp" for r in range(4)]
    assert all(per_file.values())  # the replicas' writes are spread over the ranks holding them
