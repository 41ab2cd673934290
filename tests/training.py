"""Helpers that train the built-in Decoder on a grid of real gloo processes and compare runs.

Parity tests (DESIGN.md, "The invariant") call :func:`train_layout` for a layout and for
one process with the same config, and :func:`assert_same_training` on the two.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gridtrain.config import Config, preset_config, set_fields
from gridtrain.models.decoder import Decoder
from gridtrain.parallel.comm import CommGroup
from gridtrain.parallel.experts import ExpertParallel
from gridtrain.parallel.tensor_parallel import TensorParallel, shard, split_over
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider
from gridtrain.training.loop import TrainResult, pretrain
from tests.harness import run_on_ranks


def tiny_config(**fields) -> Config:
    """The tiny preset with a parity-friendly recipe: fp64, 10 steps, no dropout, quiet."""
    cfg = preset_config("tiny")
    recipe = dict(dtype="fp64", steps=10, global_batch_size=8, micro_batch_size=2,
                  eval_interval=0, eval_iters=1, progress=False, lr=3e-3, warmup_steps=2)
    return set_fields(cfg, **{**recipe, **fields})


def summarize(result: TrainResult) -> dict:
    """Picklable record of a run: per-step losses and grad norms, final weights in fp64."""
    result.gather_weights()  # ZeRO-3's stay sharded otherwise
    state = {k: v.detach().double().cpu().numpy() for k, v in result.model.state_dict().items()}
    return {"losses": result.losses, "grad_norms": result.grad_norms, "mtp_losses": result.mtp_losses,
            "valid_loss": result.valid_loss, "valid_by_source": result.valid_by_source, "state": state, "step_bytes": result.step_bytes,
            "step_calls": result.step_calls,
            "peak_in_flight": result.peak_in_flight, "memory": result.memory,
            "recomputed": result.ctx.recompute.recomputed, "rebuilt_early": result.ctx.recompute.rebuilt_early,
            "routing": result.routing,  # MoE layers' routing per step (global counts: the same on every rank)
            "received": {layer: s.received for layer, s in result.ctx.ep.log.layers.items()},  # last step, this rank
            "fp8_scales": _fp8_scales(result.ctx.tp.fp8)}


def _fp8_scales(fp8) -> dict:
    """--fp8: the first step's scales by (weight name, operand) (float8.ScaleLog)."""
    if fp8 is None or fp8.log is None:
        return {}
    return {key: value.double().cpu().numpy() for key, value in fp8.log.entries.items()}


def _train_worker(rank: int, world_size: int, cfg: Config) -> dict:
    return summarize(pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg))


def train_layout(cfg: Config, world_size: int, timeout_s: float = 240) -> list[dict]:
    """Train ``cfg`` on ``world_size`` spawned gloo ranks; one summary per rank."""
    return run_on_ranks(_train_worker, world_size, cfg, timeout_s=timeout_s)


def _train_many_worker(rank: int, world_size: int, cfgs: list[Config]) -> list[dict]:
    return [_train_worker(rank, world_size, cfg) for cfg in cfgs]


def train_layouts(cfgs: list[Config], world_size: int, timeout_s: float = 360) -> list[list[dict]]:
    """Train each config in turn on the same spawned ranks (one spawn, several runs);
    returns, per config, one summary per rank."""
    per_rank = run_on_ranks(_train_many_worker, world_size, cfgs, timeout_s=timeout_s)
    return [[runs[i] for runs in per_rank] for i in range(len(cfgs))]


class SharedSpawns:
    """Named runs, each ``name -> (world size, fields)``, trained on demand with every run
    of the same world size in one spawn (the first run asked for starts its world's
    spawn; the others then read its results). ``config(name)`` builds a run's config."""

    def __init__(self, runs: dict[str, tuple[int, dict]], config: Callable[[str], Config], timeout_s: float = 900):
        self.runs, self.config, self.timeout_s = runs, config, timeout_s
        self._done: dict[int, dict[str, list[dict]]] = {}

    def run(self, name: str) -> list[dict]:
        """The run's summaries, one per rank."""
        world = self.runs[name][0]
        if world not in self._done:
            names = [n for n, (w, _) in self.runs.items() if w == world]
            self._done[world] = dict(zip(names, train_layouts([self.config(n) for n in names], world,
                                                              timeout_s=self.timeout_s)))
        return self._done[world][name]


def train_in_process(cfg: Config) -> dict:
    """One rank in this process (no spawn): the fast reference for single-process tests
    (pretrain makes and ends the one-rank group)."""
    return summarize(pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg))


def _train_many_with_worker(rank: int, world_size: int, cfgs: list[Config], datasets_provider) -> list[dict]:
    return [summarize(pretrain(decoder_model_provider, datasets_provider, decoder_forward_step, cfg)) for cfg in cfgs]


def train_layouts_with(cfgs: list[Config], world_size: int, datasets_provider,
                       timeout_s: float = 360) -> list[list[dict]]:
    """:func:`train_layouts` with the test's own ``datasets_provider`` (a module-level
    function, so that the spawned ranks can import it)."""
    per_rank = run_on_ranks(_train_many_with_worker, world_size, cfgs, datasets_provider, timeout_s=timeout_s)
    return [[runs[i] for runs in per_rank] for i in range(len(cfgs))]


def train_in_process_with(cfg: Config, datasets_provider) -> dict:
    """:func:`train_in_process` with the test's own ``datasets_provider``."""
    return summarize(pretrain(decoder_model_provider, datasets_provider, decoder_forward_step, cfg))


def relative_difference(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = max(np.abs(a).max(), np.abs(b).max(), 1e-30)
    return float(np.abs(a - b).max() / scale)


# In fp32, weights drift further apart than losses: some gradients are zero in exact
# arithmetic (the key bias: softmax ignores a constant added to every score), so in
# floating point they are pure rounding noise, and Adam divides by that noise's own size,
# turning it into updates of about lr * g / (|g| + eps). Different summation orders
# (threads, TP partial sums) give different noise. fp64 noise is far below Adam's eps.
FP32_WEIGHT_RTOL = 1e-3


def assert_same_training(run: dict, reference: dict, rtol: float, weight_rtol: float | None = None) -> None:
    """Per-step losses and grad norms within ``rtol``; every final weight within
    ``weight_rtol`` (default ``rtol``), relative to the largest entry of the tensor."""
    weight_rtol = rtol if weight_rtol is None else weight_rtol
    assert len(run["losses"]) == len(reference["losses"])
    for step, (x, y) in enumerate(zip(run["losses"], reference["losses"]), 1):
        assert abs(x - y) <= rtol * abs(y), f"step {step}: loss {x!r} vs reference {y!r}"
    for step, (x, y) in enumerate(zip(run["grad_norms"], reference["grad_norms"]), 1):
        assert abs(x - y) <= rtol * abs(y), f"step {step}: grad norm {x!r} vs reference {y!r}"
    assert run["state"].keys() == reference["state"].keys()
    for name, value in run["state"].items():
        diff = relative_difference(value, reference["state"][name])
        assert diff <= weight_rtol, f"{name}: relative difference {diff:.3g} > {weight_rtol:g}"


def fake_tp(size: int, rank: int) -> TensorParallel:
    """Layers only need the size and rank to shape themselves; no process group."""
    return TensorParallel(CommGroup("tp", None, size=size, rank=rank))


def assert_rank_matches(run: dict, reference: dict, cfg: Config, tp_rank: int, rtol: float = 1e-9,
                        etp_rank: int = 0) -> None:
    """Losses, grad norms and validation loss agree, and every weight this rank holds
    (its pipeline stage's) equals its TP shard of the one-process weight (kv heads it
    replicates included; a last stage's copy of the tied embedding equals the embedding;
    an expert's slice under --etp its ``etp_rank``-th)."""
    for key in ("losses", "grad_norms"):
        assert relative_difference(run[key], reference[key]) <= rtol, key
    assert abs(run["valid_loss"] - reference["valid_loss"]) <= rtol * reference["valid_loss"]
    tp, etp = fake_tp(cfg.parallel.tp, tp_rank), cfg.parallel.etp
    ep = ExpertParallel(etp=CommGroup("etp", None, size=etp, rank=etp_rank))
    model = Decoder(cfg.model, tp=tp, ep=ep)
    layout = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # buffers: a MoE's expert bias
    for name, value in run["state"].items():
        whole = name if name in reference["state"] else "embedding.word.weight"  # a tied head copy
        full = torch.from_numpy(reference["state"][whole])
        spec, group = split_over(layout[whole], tp)
        if spec is not None:
            padded = full.new_zeros(spec.full_shape(layout[whole].shape, group.size))
            padded[tuple(slice(0, n) for n in full.shape)] = full
            full = shard(padded, spec, group.rank, group.size)
        assert relative_difference(value, full.numpy()) <= rtol, name


def saved_bytes_and_formula(cfg, recompute: str, batch: int = 2) -> tuple[dict[str, int], float]:
    """One process in fp64, model config ``cfg``: the bytes each block saves for backward
    in one forward and backward of ``batch`` random sequences under the ``recompute``
    mode (the activation meter), and what the activation formula says a block keeps
    (memory.activations.korthikanti_bytes at the model's layer_shape)."""
    from gridtrain.config import ActivationsConfig
    from gridtrain.memory import activations
    from gridtrain.models.decoder import init_parameters
    from gridtrain.parallel.recompute import Recomputation, policy_from
    from gridtrain.runtime.activation_meter import ActivationMeter, saved_activations

    tp = TensorParallel()
    model = Decoder(cfg, tp=tp, recompute=Recomputation(policy_from(ActivationsConfig(recompute=recompute)), tp.rng))
    init_parameters(model, 0)
    model.double()
    meter = ActivationMeter.for_model(model)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    with saved_activations(meter):
        model(tokens, tokens).sum().backward()
    shape = activations.layer_shape(cfg, batch=batch, tp=1, sequence_parallel=False, element_bytes=8, mask_bytes=8)
    return meter.by_layer(), activations.korthikanti_bytes(recompute=recompute, **shape)
