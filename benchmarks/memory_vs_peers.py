"""Per-rank step peak of gridtrain's ZeRO stages beside its peers' (issue 55): PyTorch
FSDP2 measured by torch's own FSDPMemTracker, and Megatron's distributed optimizer as a
closed form. Counts, not timings: everything runs on fake tensors with torch's fake
process group, in this process; the table is the same on any machine.

Cases (``--cases``, default both): ``8b``, Llama 3 8B (the ``llama3-8b`` preset) at seq
8192, micro-batch 1; ``tinyllama``, TinyLlama 1.1B (the ``tinyllama-1.1b`` preset: 22
layers, d_model 2048, 32 heads, 4 kv heads, ffn 5632, vocab 32000) at seq 4096,
micro-batch 2. Both on 8 data-parallel ranks (``--world-size``), bf16, full
recomputation, no dropout, one micro-batch per rank and step (global batch 8 x
micro-batch).

* **gridtrain**: the dry run (gridtrain/dryrun.py ``dry_run``, what ``gridtrain train ...
  --dry-run --world-size 8 --dry-run-ranks 0`` runs) of rank 0: ``trainer.build`` and one
  ``Trainer.train_step`` on fake CPU tensors (``--device cpu``), for ``--zero 3`` with the
  default head (automatic ``--loss-chunks``: the fused, chunked head and loss) and with
  ``--loss-chunks 0`` (the unfused head and torch-style cross entropy: the peer's loss),
  and for ``--zero 1`` and ``--zero 2``. Reported: the report's ``peak_bytes`` (every
  storage alive on the device at the step's high point).
* **FSDP2** (the peer of the ZeRO-3 rows): gridtrain's own ``Decoder`` (so the math is the
  same), built on fake CPU tensors with ``loss_chunks=0`` (the unfused head), sharded as
  torchtitan does it: ``checkpoint_wrapper(block, preserve_rng_state=False)``
  (non-reentrant activation checkpointing of every block: full recomputation), then
  ``fully_shard`` on the token embedding, on every block and on the root (final norm and
  head, whose weight is a parameter of the root itself) over a 1-D mesh of
  ``--world-size`` ranks (``--fsdp-units blocks``: no unit for the embedding, which then
  belongs to the root), with FSDP2's defaults otherwise (``reshard_after_forward=None``:
  the embedding and every block resharded after their forward and gathered again for
  their backward, the root kept gathered) and
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 sharded parameters:
  the master weights). The loss as torchtitan computes it (``--fsdp-loss titan``): the
  model returns the logits, then ``F.cross_entropy(logits.flatten(0, 1).float(),
  labels.flatten(0, 1))`` (``--fsdp-loss decoder``: the Decoder's own unfused head and
  cross entropy, ``model(tokens, labels, reduction="sum") / tokens``).
  ``torch.optim.AdamW`` on the sharded parameters (``--fsdp-adamw``: ``fused`` by default, torchtitan's default; ``foreach``)
  with gridtrain's parameter groups. Two training steps (forward, loss,
  backward, AdamW step, ``zero_grad(set_to_none=True)``) under
  ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` as torchtitan's memory
  estimator does it (``track_inputs`` of the batch, ``reset_mod_stats`` after the
  first); the figure is the tracker's peak total (its ``get_tracker_snapshot("peak")``):
  the second step's, the first having no optimizer state yet. Two adjustments, both
  said in the output: the Decoder's rotary tables (fp32 buffers, which gridtrain casts
  with the model) are cast to bf16, since FSDP2's policy casts parameters only and
  attention refuses fp32 queries beside bf16 values (torchtitan computes the rotation in
  fp32 and casts back: the difference is a transient of one block's q and k); and
  DTensor's sharding propagation is given a fake mode of its own
  (``torch.distributed.tensor._sharding_prop.detect_fake_mode`` replaced during the
  run). Without that, under an outer ``FakeTensorMode`` the propagation runs in the very
  mode the tracker was entered in, and the tracker counts its global-shape stand-ins as
  memory (its test is ``active_fake_mode() is`` the mode at entry): 8 times every
  sharded tensor an op touches: 116 GB (foreach AdamW) to 145 GB (fused) for the 8B
  instead of ~28-29 GB, all of it counted as optimizer state. With it, the tracker's peak on fake tensors
  equals its peak on real tensors exactly (checked at the start of every run on the
  ``llama-tiny`` preset, dp 8: the ``self-check`` line; ``--no-self-check`` skips it).
* **Megatron's distributed optimizer** (the peer of the ZeRO-1 and ZeRO-2 rows), a closed
  form per rank: bf16 parameters ``2 P`` + fp32 gradients ``4 P`` (ZeRO-1; ``4 P / dp``
  for ZeRO-2) + optimizer state ``12 P / dp`` (fp32 master weights and AdamW's two
  moments), plus an activation peak; ``P`` the model's parameters (the dry run's
  ``parameters``). The activation peak added is gridtrain's own, the dry run report's
  ``activation_peak_bytes`` of the same run (the saved-activation meter's peak, equal to
  ``memory.model.expected_activation_peak``: the 32 blocks' checkpointed inputs, 2.15 GB
  for the 8B, plus the head's saved bytes, 2.30 GB, = 4.45 GB), so the closed form is
  what Megatron would hold with gridtrain's activations and no transient buffers.
  The issue's 64.61 / 36.50 GB (8B) correspond to 4.383 GB of activations, 67.1 MB (one
  ``[seq, d_model]`` bf16 tensor: one block's checkpointed input) less than this
  report's 4.450 GB, which gives 64.68 / 36.57 GB.

The table: run | gridtrain step peak | peer | ratio (gridtrain / peer), in GB of 1e9
bytes (the issue's unit: ``peak_bytes / 1e9``), then per run where the peak occurs (the
operation that raised the step's live bytes to it: for gridtrain the innermost gridtrain
frame and whether autograd's backward was running, recorded by wrapping the dry run's
``LiveBytes`` counter; for FSDP2 the tracker's phase and the innermost module then
active) and the peer's breakdown at its peak (the tracker's categories).

    python3 benchmarks/memory_vs_peers.py                    # both cases, ~2 min on 2 busy CPU cores
    python3 benchmarks/memory_vs_peers.py --cases tinyllama  # ~1 min
    python3 benchmarks/memory_vs_peers.py --fsdp-units blocks --fsdp-loss decoder   # FSDP2 variants
    python3 benchmarks/memory_vs_peers.py --cases 8b --fsdp-adamw foreach

The FSDP2 variants at the 8B, for reference (torch 2.13, CPU): torchtitan's units and loss
27.99 GB (the issue's figure); ``--fsdp-units blocks`` 29.04 GB (the token table, 1.05 GB
of bf16, stays gathered with the root); ``--fsdp-units blocks --fsdp-loss decoder``
29.48 GB (the peak moves to where the last block's parameters, 0.44 GB, are already
being gathered for its backward). Each peak is in the second step's backward of the
loss: two fp32 logits-sized gradients (8.41 GB) beside the saved fp32 log-softmax
(4.20 GB, in ``act`` with the blocks' 2.15 GB of checkpointed inputs).

The script imports the gridtrain of the checkout it sits in (the folder above
``benchmarks/``), whatever is installed, and prints which.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's gridtrain, not an installed one

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gridtrain  # noqa: E402
from gridtrain import dryrun  # noqa: E402
from gridtrain.config import Config, preset_config, set_fields  # noqa: E402

GB = 1e9


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    seq_len: int
    micro_batch_size: int


CASES = {
    "8b": Case("Llama 3 8B", "llama3-8b", 8192, 1),
    "tinyllama": Case("TinyLlama 1.1B", "tinyllama-1.1b", 4096, 2),
}

RUNS = [  # (label, training settings)
    ("ZeRO-3, full recomputation, default head", {"zero": 3}),
    ("ZeRO-3, full recomputation, unfused head (`--loss-chunks 0`, the peer's loss)", {"zero": 3, "loss_chunks": 0}),
    ("ZeRO-1, full recomputation", {"zero": 1}),
    ("ZeRO-2, full recomputation", {"zero": 2}),
]


def config(case: Case, world: int, **extra) -> Config:
    cfg = preset_config(case.preset)
    cfg.model.seq_len = case.seq_len
    cfg.model.dropout = 0.0
    cfg.training.device, cfg.training.dtype = "cpu", "bf16"
    cfg.training.micro_batch_size = case.micro_batch_size
    cfg.training.global_batch_size = world * case.micro_batch_size  # one micro-batch per rank
    cfg.metrics.progress = False
    set_fields(cfg, recompute="full", **extra)
    return cfg


# ---- gridtrain: the dry run of rank 0 ------------------------------------------------------------

def _gridtrain_frame() -> str:
    """The innermost frame of gridtrain's code (not the dry run's own) on the stack."""
    f = sys._getframe(2)
    pkg, skip = str(Path(gridtrain.__file__).parent), str(Path(dryrun.__file__))
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(pkg) and name != skip:
            return f"{Path(name).relative_to(Path(pkg).parent)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "outside gridtrain"


@contextlib.contextmanager
def peak_sites():
    """The dry run's live-bytes counter, wrapped so that each instance also records where
    its peak was reached (the last rise): yields the list of instances made."""
    made = []
    original = getattr(dryrun, "LiveBytes", None)
    if original is None:
        yield made
        return

    class WhereLiveBytes(original):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.where = "?"
            made.append(self)

        def track(self, *given):
            before = self.peak
            super().track(*given)
            if self.peak > before:
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward/step"
                self.where = f"{phase}: {_gridtrain_frame()}"

    dryrun.LiveBytes = WhereLiveBytes
    try:
        yield made
    finally:
        dryrun.LiveBytes = original


def gridtrain_run(cfg: Config, world: int) -> dict:
    with peak_sites() as counters:
        began = time.perf_counter()
        report = dryrun.dry_run(cfg, world, "0", out=lambda *a, **k: None)
    r = report["ranks"][0]
    r["where"] = next((c.where for c in reversed(counters) if c.peak == r["peak_bytes"]), "?")
    r["wall"] = time.perf_counter() - began
    return r


# ---- FSDP2 under FSDPMemTracker -------------------------------------------------------------------

@dataclass
class FSDPResult:
    peak: int
    breakdown: dict[str, int]
    where: str
    wall: float
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def own_propagation_mode():
    """DTensor's sharding propagation in a fake mode of its own (see the docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        import torch.distributed.tensor._sharding_prop as sharding_prop
    except ImportError:
        yield False
        return
    if not hasattr(sharding_prop, "detect_fake_mode"):
        yield False
        return
    mode = FakeTensorMode()
    saved = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *a, **k: mode
    try:
        yield True
    finally:
        sharding_prop.detect_fake_mode = saved


def fsdp2_run(cfg: Config, world: int, adamw: str = "fused", units: str = "titan", loss_kind: str = "titan", *,
              fake: bool = True) -> FSDPResult:
    """Two steps of gridtrain's Decoder under FSDP2 (torchtitan's wrapping), rank 0 of
    ``world`` on the fake process group, under FSDPMemTracker; ``fake=False``: real
    tensors (the self-check; tiny models only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn import functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gridtrain.models.decoder import Decoder
    from gridtrain.optim.optimizer import param_groups

    class WhereTracker(FSDPMemTracker):
        """Records the phase and the innermost active module at each rise of the peak."""
        where, step = "?", 0

        def _update_peak_stats(self, peak_state):
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != before:
                mods = [m for m in self._mod_tracker.parents if m != "Global"]
                phase = "optimizer" if self._in_opt else ("backward" if self._mod_tracker.is_bw else "forward")
                self.where = f"step {self.step}, {phase}: {max(mods, key=len, default='no module (the loss, outside the model)')}"

    began = time.perf_counter()
    m = copy.deepcopy(cfg.model)
    mb, seq = cfg.training.micro_batch_size, m.seq_len
    notes = []
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside the fake mode: the mesh reads its ranks
        with contextlib.ExitStack() as stack:
            if fake:
                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            if not stack.enter_context(own_propagation_mode()):
                notes.append("DTensor's propagation could not be given its own fake mode: the tracker over-counts")
            model = Decoder(m, loss_chunks=0)
            cast = 0
            for mod in model.modules():  # the rotary tables, as gridtrain casts them with the model
                for name, b in list(mod._buffers.items()):
                    if b is not None and b.is_floating_point() and b.dtype != torch.bfloat16:
                        mod._buffers[name] = b.to(torch.bfloat16)
                        cast += b.numel()
            if cast:
                notes.append(f"FSDP2: {cast:,} elements of fp32 buffers (rotary tables) cast to bf16")
            for key in list(model.blocks.keys()):
                model.blocks[key] = checkpoint_wrapper(model.blocks[key], preserve_rng_state=False)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if units == "titan":  # torchtitan's: the token table a unit of its own
                fully_shard(model.embedding, mesh=mesh, mp_policy=policy)
            for block in model.blocks.values():
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            o = cfg.optim
            impl = {"fused": {"fused": True}, "foreach": {"foreach": True}}[adamw]
            opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                    eps=o.adam_eps, **impl)
            tokens = torch.randint(0, m.vocab_size, (mb, seq))
            labels = torch.randint(0, m.vocab_size, (mb, seq))
            tracker = WhereTracker(model, opt)
            tracker.track_inputs((tokens, labels))
            with tracker:
                for step in (1, 2):
                    tracker.step = step
                    if loss_kind == "titan":  # torchtitan's: logits out, then an fp32 cross entropy
                        logits = model(tokens)
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
                        del logits
                    else:  # the Decoder's own unfused head and loss (loss_chunks=0), summed
                        loss = model(tokens, labels, reduction="sum") * (1.0 / tokens.numel())
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    del loss
                    if step == 1:
                        tracker.reset_mod_stats()
            snap = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    total = sum(d.get("Total", 0) for d in snap.values())
    parts: dict[str, int] = {}
    for d in snap.values():
        for k, v in d.items():
            if k != "Total" and v:
                key = str(k).split(".")[-1]
                parts[key] = parts.get(key, 0) + v
    return FSDPResult(total, parts, tracker.where, time.perf_counter() - began, notes)


def self_check(world: int, *opts: str) -> str:
    """The tracker's FSDP2 peak of llama-tiny on fake and on real tensors: equal if the
    fake run counts what a real one allocates."""
    cfg = preset_config("llama-tiny")
    cfg.model.dropout = 0.0
    cfg.training.micro_batch_size = 2
    fake, real = fsdp2_run(cfg, world, *opts), fsdp2_run(cfg, world, *opts, fake=False)
    verdict = "equal" if fake.peak == real.peak else "DIFFER: the FSDP2 figures below are not to be trusted"
    return f"self-check (llama-tiny, FSDP2 under FSDPMemTracker): fake {fake.peak:,} B, real {real.peak:,} B: {verdict}"


# ---- Megatron's distributed optimizer -------------------------------------------------------------

def megatron_bytes(params: int, dp: int, zero: int, activations: float) -> float:
    """bf16 parameters, fp32 gradients (whole, or a 1/dp shard for ZeRO-2), fp32 master
    and two moments sharded over dp, plus the activation peak."""
    grads = 4 * params if zero == 1 else 4 * params / dp
    return 2 * params + grads + 12 * params / dp + activations


# ---- the table ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="8b,tinyllama", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--world-size", type=int, default=8, help="data-parallel ranks (default: %(default)s)")
    ap.add_argument("--fsdp-adamw", choices=("fused", "foreach"), default="fused",
                    help="FSDP2's AdamW implementation (default: %(default)s, torchtitan's)")
    ap.add_argument("--fsdp-units", choices=("titan", "blocks"), default="titan",
                    help="FSDP2's units: torchtitan's (the token embedding, every block, the root) or every "
                         "block and the root (default: %(default)s)")
    ap.add_argument("--fsdp-loss", choices=("titan", "decoder"), default="titan",
                    help="FSDP2's loss: torchtitan's (logits, then cross entropy in fp32) or the Decoder's own "
                         "unfused head and loss (default: %(default)s)")
    ap.add_argument("--no-self-check", action="store_true", help="skip the fake-vs-real check of the tracker")
    args = ap.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    world = args.world_size
    peer_opts = (args.fsdp_adamw, args.fsdp_units, args.fsdp_loss)
    began = time.perf_counter()
    print(f"gridtrain from {Path(gridtrain.__file__).parent}, torch {torch.__version__}; "
          f"dp {world}, bf16, full recomputation, rank 0, fake tensors and process group; GB = 1e9 bytes")
    if not args.no_self_check:
        print(self_check(world, *peer_opts), flush=True)
    rows, details = [], []
    for name in names:
        case = CASES[name]
        shape = f"{case.name}, dp {world}, seq {case.seq_len}, micro-batch {case.micro_batch_size}"
        measured = {label: gridtrain_run(config(case, world, **extra), world) for label, extra in RUNS}
        peer = fsdp2_run(config(case, world), world, *peer_opts)
        for label, extra in RUNS:
            r = measured[label]
            if extra["zero"] == 3:
                ref, text = peer.peak, f"FSDP2 {peer.peak / GB:.2f} GB"
            else:
                ref = megatron_bytes(r["parameters"], world, extra["zero"], r["activation_peak_bytes"])
                text = (f"Megatron's distributed optimizer: closed form + activation peak "
                        f"({r['activation_peak_bytes'] / GB:.2f}) {ref / GB:.2f} GB")
            rows.append(f"| {case.name}: {label} | {r['peak_bytes'] / GB:.2f} GB | {text} | "
                        f"{r['peak_bytes'] / ref:.2f}x ({r['peak_bytes'] - ref:+,.0f} B) |")
            details.append(f"| {shape} | gridtrain {label} | {r['parameter_bytes'] / GB:.2f} | "
                           f"{r['gradient_bytes'] / GB:.2f} | {r['optimizer_bytes'] / GB:.2f} | "
                           f"{r['activation_peak_bytes'] / GB:.2f} | {r['peak_bytes'] / GB:.2f} | {r['where']} | "
                           f"{r['wall']:.0f} |")
        parts = ", ".join(f"{k.lower()} {v / GB:.2f}" for k, v in sorted(peer.breakdown.items(), key=lambda kv: -kv[1]))
        details.append(f"| {shape} | FSDP2 (units {args.fsdp_units}, loss {args.fsdp_loss}, AdamW {args.fsdp_adamw}) | | | | | {peer.peak / GB:.2f} | "
                       f"{peer.where}; at the peak: {parts} | {peer.wall:.0f} |")
        for note in dict.fromkeys(peer.notes):
            print(f"note: {note}")
        print(f"{case.name}: done ({time.perf_counter() - began:.0f} s so far)", flush=True)
    print()
    print("| run | gridtrain step peak | peer | ratio |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(row)
    print()
    print("| case | side | params GB | grads GB | optimizer GB | activation peak GB | step peak GB | "
          "where the peak is reached | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in details:
        print(row)
    print(f"\nwall time {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
