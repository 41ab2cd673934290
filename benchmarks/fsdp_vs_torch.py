"""Fully sharded data parallelism side by side: gridtrain's ZeRO stages against PyTorch FSDP2.

The same Decoder (shape, initial weights, batch, loss, optimizer) is trained for a few
steps on two gloo processes, one data-parallel rank each, in several ways, alternating
inside the same two processes:

* ``gridtrain --zero Z`` for every stage Z of ``--zero`` (default ``3,2``; 0 and 1 are
  accepted too, as references): the real training step, built by
  ``gridtrain.training.trainer.build`` on a config with ``parallel.dp = 2, zero = Z``
  (``decoder_model_provider``, ``broadcast_parameters``, the one-stage pipeline: a
  gradient-accumulation loop over the rank's micro-batches, the gradient reducer, the
  optimizer the stage asks for) and stepped with ``Trainer.train_step``: the global token
  count, the forwards and backwards, the gradient reduction, the global gradient norm
  (``grad_clip = 0``: computed, not applied), AdamW, the mean loss. With 3 in the list
  (and without ``--no-keep-gathered``), also ``gridtrain --zero 3
  --zero3-keep-gathered`` (``parallel.zero3_keep_gathered = True``: a block's
  parameters stay gathered from its first forward to its last backward of the step).
* ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` on every transformer ``Block`` and
  on the root ``Decoder`` (embedding, final norm and the tied head: one unit), on a
  ``init_device_mesh("cpu", (2,))``, around gridtrain's own Decoder initialised with
  ``init_parameters`` (so the math and the starting weights are the same), with FSDP2's
  defaults: ``reshard_after_forward=None`` (True for each block: its parameters are
  all-gathered for its forward, freed, and all-gathered again for its backward, per
  micro-batch; False for the root, gathered once per micro-batch), the gradients
  reduce-scattered after every micro-batch's backward (``--fsdp-grad-sync last``: only
  after the last, ``set_requires_gradient_sync(False)`` before, which keeps unsharded
  gradients meanwhile). Each micro-batch's summed token loss times ``1 / tokens per
  rank`` (= gridtrain's ``dp / global tokens``; FSDP2 averages over the 2 ranks), the
  global gradient norm (``torch.nn.utils.get_total_norm`` over the sharded gradients,
  then ``full_tensor``: what gridtrain's step computes too), ``torch.optim.AdamW`` with
  gridtrain's parameter groups and hyper-parameters on the sharded DTensor parameters
  (``--fsdp-adamw``: ``fused`` by default, torch's one-kernel AdamW, which takes DTensor
  parameters on the CPU in torch 2.13; ``foreach``; ``for-loop``, what torch picks for
  CPU tensors when told nothing), and the mean loss all-reduced for the log.
* ``FSDP2 reshard_after_forward=False``: the same with ``reshard_after_forward=False``
  and ``set_reshard_after_backward(False)`` on every micro-batch but the last, so each
  unit is gathered once per step and kept until the step's last backward: FSDP2's
  counterpart of ``--zero3-keep-gathered`` (``--no-keep-gathered`` skips both).
* ``gridtrain 1 process``: ``train_step`` with dp 1 and no ZeRO over all the micro-batches
  of the global batch, on rank 0 with every core while rank 1 waits in a barrier:
  the loss every layout must reproduce (``--reference`` adds it; off by default, as its
  two threads can collapse on a busy machine and double the run's time).

A step is: zero the gradients, m micro-batches of forward + backward (mean token cross
entropy over the global batch), gradient averaging over the 2 ranks, the gradient norm,
AdamW (lr 1e-3 constant, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices and
embeddings). fp32 by default (``--dtype bf16``: gridtrain's bf16 parameters with fp32
master weights against FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` on fp32 sharded parameters), no dropout, no LR schedule, no data
loading: the global batch is fixed random token ids (same seed everywhere); rank r trains
its m micro-batches r*m .. r*m + m - 1.

**Memory, measured the same way for every side.** There is no allocator statistic for
CPU tensors, and all the sides live in the same two processes, so a process-level number
(RSS) cannot tell them apart. The script counts live tensor bytes instead: a
``TorchDispatchMode`` (:class:`TensorLedger`) sees the output of every aten operator,
records each new tensor storage once (views share their storage) with the side that was
being built or stepped when it appeared and its size, follows size changes (outputs of
``resize_`` and ``torch.UntypedStorage.resize_``, which FSDP2 uses to free and refill
its gathered parameters and which no operator reports: patched while the mode is on),
and drops a storage when its Python object is finalised (storages keep one Python
object for their lifetime). Wrapper subclasses (DTensor) are counted through their local
tensors: the mode declines DTensor operators (returns ``NotImplemented``, as torch's
``MemTracker`` does), so DTensor runs them as plain operators on its local shards, which
the mode then sees; DTensor's shape propagation under its own fake mode is skipped. The
mode is on while the sides are built and during the warm-up steps, off during the timed
rounds (no overhead in the timings). Reported per side and rank:

* **peak**: the largest live bytes of the side during its last warm-up step (a steady
  step once ``--warmup`` >= 2: the optimizer's state exists before it starts), its
  held bytes included;
* **held**: the side's live bytes after that step, garbage collected: parameters,
  gradients, optimizer state and whatever else the side keeps between steps (for
  gridtrain ZeRO-1, the parameter all-gather buffers that the next forward consumes).

Not counted: the batch (made before the sides, the same for all), gloo's own buffers
(not tensors), Python objects. Checks printed: the running count against the storages'
sizes summed afresh after the warm-up (equal unless a resize went unseen), and the
FSDP2 side's last warm-up step also run under torch's own
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (``--no-memtracker`` skips
it), whose peak is printed beside the ledger's (within 0.1% of each other at the
default shape). The same mode counts each side's collectives in that step (calls and bytes,
rank 0; bytes of the whole tensor: an all-gather's output, a reduce-scatter's input, an
all-reduce's tensor).

Timing (benchmarks/common.py): every side first runs ``--warmup`` untimed steps; then
``--repeats`` rounds, each timing ``--steps`` steps of every side in turn (the order
reversed every other round), between two barriers, with ``time.perf_counter`` on rank 0.
Reported: medians over rounds, the best round, and the tokens/s ratio gridtrain / FSDP2
(and / FSDP2 reshard_after_forward=False) paired per round; then the losses and gradient
norms of all sides, step by step (every side has taken the same number of steps from
the same weights on the same batch, so they must agree: within 1e-5 relative in fp32,
the project's parity bound; within 5e-3 in bf16, about one bf16 rounding).

FSDP2 on the CPU with gloo (torch 2.13): everything used here works (``fully_shard``,
its all-gathers and reduce-scatters on gloo, ``MixedPrecisionPolicy`` with bf16, fused
AdamW on DTensors). Caveats met: FSDP2 warns that the root returned a view (the
Decoder's per-token losses; harmless, as the loss is summed out of place; the warning is
filtered); ``FSDPMemTracker`` refuses a second forward of the root within one tracked
region (gradient accumulation) unless ``reset_mod_stats`` is called between them (done
from a global forward pre-hook, which runs before FSDP2's own); passing
``reshard_after_forward=True`` explicitly also reshards the root (one more all-gather,
the root's again for its backward, per micro-batch than the default ``None``); on 2 cores gloo's communication threads compete
with the two ranks' compute, so little of FSDP2's per-block traffic overlaps; bf16 runs
about 10x slower than fp32 on this CPU, for both sides.

Run from the repository root::

    python3 benchmarks/fsdp_vs_torch.py                     # --zero 3,2: 5 sides, ~2 min on 2 busy cores
    python3 benchmarks/fsdp_vs_torch.py --zero 1 --no-keep-gathered   # ZeRO-1 vs FSDP2 only, ~50 s
    python3 benchmarks/fsdp_vs_torch.py --zero 3,2,1 --d-model 256 --n-layer 8 --steps 2 --repeats 6
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import common  # benchmarks/common.py: the script's own folder is on sys.path
from common import Side, format_bytes, med, mib
from gridtrain.config import Config, ParallelConfig
from gridtrain.models.decoder import Decoder, init_parameters
from gridtrain.optim.optimizer import param_groups
from gridtrain.training.trainer import Trainer

DP = 2
STAGES = (0, 1, 2, 3)
FP32_TOLERANCE = 1e-5  # relative, per step: the project's fp32 parity bound (shared/DESIGN.md)
BF16_TOLERANCE = 5e-3  # relative: about one bf16 rounding (8 significant bits)
FSDP = "FSDP2"
FSDP_KEEP = "FSDP2 reshard_after_forward=False"


# ---- live tensor bytes ---------------------------------------------------------------------------

class TensorLedger(TorchDispatchMode):
    """Live tensor bytes per owner (the side being built or stepped), with a peak per owner
    and the collectives each owner starts (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.owner = "other"
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.comm: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self._records = WeakIdKeyDictionary()  # storage -> [owner, bytes]
        self._resize = None
        self._fake_on_entry = None

    @contextlib.contextmanager
    def owning(self, owner: str):
        before, self.owner = self.owner, owner
        try:
            yield
        finally:
            self.owner = before

    def __enter__(self):
        self._fake_on_entry = active_fake_mode()
        self._resize = original = torch.UntypedStorage.resize_
        ledger = self

        def resize_(storage, size):  # not an operator: the dispatch mode never sees it
            out = original(storage, size)
            ledger._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs it on its local tensors, which come back here
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_on_entry:  # not DTensor's shape propagation
            if func.namespace in ("c10d", "_c10d_functional"):
                self._count(func, args, out)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
            return
        record = self._records.get(storage)
        if record is None:
            record = [self.owner, storage.nbytes()]
            self._records[storage] = record
            weakref.finalize(storage, self._freed, record)
            self._add(record[0], record[1])
        elif storage.nbytes() != record[1]:  # resized in place (aten resize_ / set_)
            self._resized(storage)

    def _resized(self, storage) -> None:
        record = self._records.get(storage)
        if record is not None:
            n = storage.nbytes()
            self._add(record[0], n - record[1])
            record[1] = n

    def _freed(self, record: list) -> None:
        self.live[record[0]] -= record[1]
        record[1] = 0

    def _add(self, owner: str, n: int) -> None:
        self.live[owner] += n
        if self.live[owner] > self.peak[owner]:
            self.peak[owner] = self.live[owner]

    def _count(self, func, args, out) -> None:
        name = func._opname
        kind = ("all-gather" if "allgather" in name or "all_gather" in name else
                "reduce-scatter" if "reduce_scatter" in name else
                "all-reduce" if "allreduce" in name or "all_reduce" in name else
                "broadcast" if "broadcast" in name else None)
        if kind is None:  # barriers, waits
            return

        def nbytes(x) -> int:
            return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))

        entry = self.comm[self.owner][kind]
        entry[0] += 1
        entry[1] += max(nbytes(args[:1]), nbytes(args[1:2]), nbytes(out))

    def recount(self) -> dict[str, int]:
        """Live bytes per owner summed afresh from the storages' current sizes (valid also
        after the mode was off, when a resize went unseen)."""
        totals: dict[str, int] = defaultdict(int)
        for storage, record in list(self._records.items()):
            record[1] = storage.nbytes()
            totals[record[0]] += record[1]
        return dict(totals)


# ---- the sides -----------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Setup(Side):
    step_fn: Callable[[], tuple[float | None, float | None]]  # one step -> (global mean loss, grad norm)
    kind: str  # "gridtrain", "fsdp", "reference"
    stage: int | None = None  # gridtrain's ZeRO stage
    keep: bool = False  # parameters kept gathered through the step
    losses: list[float | None] = field(default_factory=list)  # every step, warm-up included
    norms: list[float | None] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def gridtrain_name(stage: int, keep: bool = False) -> str:
    return f"gridtrain --zero {stage}" + (" --zero3-keep-gathered" if keep else "")


def gridtrain_setup(name: str, trainer: Trainer, batches: list[dict], kind: str = "gridtrain", **side) -> Setup:
    def step() -> tuple[float, float]:
        out = trainer.train_step(batches)
        return out.loss, out.grad_norm

    p = trainer.cfg.parallel
    return Setup(name=name, step_fn=step, kind=kind, stage=p.zero,
                 keep=getattr(p, "zero3_keep_gathered", False), **side)


def fsdp_setup(cfg: Config, batches: list[dict], opts: dict, mesh, *, keep: bool) -> Setup:
    """gridtrain's Decoder under ``fully_shard`` (every Block, then the root), AdamW on the
    sharded parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = Decoder(cfg.model)
    init_parameters(model, cfg.training.seed)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if opts["dtype"] == "bf16" else MixedPrecisionPolicy())
    reshard = False if keep else None  # None, FSDP2's default: True for the blocks, False for the root
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    o = cfg.optim
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[opts["fsdp_adamw"]]
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.adam_eps,
                            **impl)
    params = [p for p in model.parameters() if p.requires_grad]
    local_tokens = sum(b["labels"].numel() for b in batches)
    global_tokens = DP * local_tokens
    sync_every = opts["fsdp_grad_sync"] == "every"

    def step() -> tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            if keep:  # gathered once per step: free them only after the last backward
                model.set_reshard_after_backward(last)
            if not sync_every:
                model.set_requires_gradient_sync(last)
            summed = model(b["tokens"], b["labels"]).sum()  # gridtrain's decoder_forward_step
            (summed * (1.0 / local_tokens)).backward()
            loss_sum += summed.detach().to(torch.float64)  # as gridtrain's pipeline adds it up
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        opt.step()
        dist.all_reduce(loss_sum)  # the global mean loss, for the log (gridtrain does the same)
        return float(loss_sum) / global_tokens, float(norm)

    s = Setup(name=FSDP_KEEP if keep else FSDP, step_fn=step, kind="fsdp", keep=keep)
    s.info.update(model=model, optimizer=opt)
    return s


# ---- the worker ----------------------------------------------------------------------------------

def _worker(rank: int, world: int, opts: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    n_mb, mbs = opts["microbatches"], opts["micro_batch_size"]
    cfg = _config(opts, 0)  # the FSDP2 sides' model and the batch
    everything = common.random_batches(cfg, DP * n_mb * mbs)  # the global batch, outside the ledger
    mine = everything[rank * n_mb:(rank + 1) * n_mb]
    ledger = TensorLedger()
    notes: list[str] = []
    setups: list[Setup] = []

    def add(name: str, make: Callable[[], Setup]) -> None:
        with ledger.owning(name):
            setups.append(make())

    with ledger:
        for z in opts["zero"]:
            add(gridtrain_name(z), lambda z=z: gridtrain_setup(gridtrain_name(z), common.build_gpt(_config(opts, z)),
                                                                mine))
        if 3 in opts["zero"] and opts["keep_gathered"]:
            name = gridtrain_name(3, True)
            add(name, lambda: gridtrain_setup(name, common.build_gpt(_config(opts, 3, keep=True)), mine))
        mesh = init_device_mesh("cpu", (DP,))
        add(FSDP, lambda: fsdp_setup(cfg, mine, opts, mesh, keep=False))
        if opts["keep_gathered"]:
            add(FSDP_KEEP, lambda: fsdp_setup(cfg, mine, opts, mesh, keep=True))
        if opts["reference"]:
            name = "gridtrain 1 process"
            add(name, lambda: gridtrain_setup(name, common.build_gpt_one_process(_config(opts, 0)), everything,
                                              "reference", active=rank == 0,
                                              threads=common.reference_threads(opts)))

        # warm-up, measured: every step's peak, and after the last one the held bytes
        for s in setups:
            for i in range(opts["warmup"]):
                measured = _measured_step(s, ledger, tracker=opts["memtracker"] and s.name == FSDP
                                          and i == opts["warmup"] - 1)
                if "memtracker_error" in measured:
                    notes.append(f"{s.name}: FSDPMemTracker failed: {measured.pop('memtracker_error')}")
                s.memory = measured
        gc.collect()
        drift = {k: (ledger.live[k], v) for k, v in ledger.recount().items() if ledger.live[k] != v}

    def run_block(s: Setup, steps: int) -> tuple[float, None]:
        def run() -> None:
            for _ in range(steps):
                loss, norm = s.step_fn()
                s.losses.append(loss)
                s.norms.append(norm)
        return common.between_barriers(s, run)

    common.timed_rounds(setups, opts, run_block)

    fsdp_model = next(s for s in setups if s.name == FSDP).info["model"]
    return {
        "setups": [{"name": s.name, "kind": s.kind, "stage": s.stage, "keep": s.keep, "active": s.active,
                    "times": s.times, "losses": s.losses, "norms": s.norms,
                    "memory": s.memory} for s in setups],
        "ledger_drift": drift,
        "threads_per_rank": torch.get_num_threads(),
        "params": sum(p.numel() for p in fsdp_model.parameters()),
        "padded_vocab": fsdp_model.padded_vocab,
        "notes": notes,
    }


def _measured_step(s: Setup, ledger: TensorLedger, tracker: bool) -> dict:
    """One (warm-up) step of ``s`` between barriers, owned by it in the ledger: its peak,
    its held bytes after, its collectives; optionally under torch's FSDPMemTracker too."""
    gc.collect()
    out: dict = {}
    ledger.peak[s.name] = ledger.live[s.name]
    ledger.comm.pop(s.name, None)
    fmt = hook = None
    if tracker and s.active:
        try:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
            root = s.info["model"]
            tracking = FSDPMemTracker(root, s.info["optimizer"])
            # It refuses a second forward of the root in one tracked region (gradient
            # accumulation) unless its module-wise statistics, not its peak, are reset in
            # between: done before every root forward, from a global hook (global hooks run
            # before the module's own, where FSDP2's and the tracker's are).
            hook = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, _: tracking.reset_mod_stats() if module is root else None)
            fmt = tracking
        except Exception as e:  # noqa: BLE001 - a cross-check: reported, never fatal
            out["memtracker_error"] = f"{type(e).__name__}: {e}"

    def run() -> None:
        with ledger.owning(s.name), (fmt if fmt is not None else contextlib.nullcontext()):
            loss, norm = s.step_fn()
        s.losses.append(loss)
        s.norms.append(norm)

    try:
        common.between_barriers(s, run)
    finally:
        if hook is not None:
            hook.remove()
    gc.collect()
    out.update(peak=ledger.peak[s.name], held=ledger.live[s.name],
               comm={k: tuple(v) for k, v in ledger.comm.get(s.name, {}).items()})
    if fmt is not None:
        snap = fmt.get_tracker_snapshot("peak")
        out["memtracker_peak"] = sum(d.get("Total", 0) for d in snap.values())
    return out


# ---- parent: configuration and report ---------------------------------------------------------

def _config(opts: dict, zero: int, keep: bool = False) -> Config:
    mbs = opts["micro_batch_size"]
    extra = {"zero3_keep_gathered": True} if keep else {}  # only named when used
    parallel = ParallelConfig(nproc=DP, dp=DP, zero=zero, bucket_mb=opts["bucket_mb"], **extra)
    return common.make_config(opts, parallel, micro_batch_size=mbs, global_batch_size=DP * opts["microbatches"] * mbs,
                              dtype=opts["dtype"])


def _configs(opts: dict) -> list[Config]:
    cfgs = [_config(opts, z) for z in opts["zero"]]
    if 3 in opts["zero"] and opts["keep_gathered"]:
        cfgs.append(_config(opts, 3, keep=True))
    return cfgs or [_config(opts, 0)]


def _pair(rows: list[dict], r: dict, fsdp: str) -> str:
    peer = next((x for x in rows if x["name"] == fsdp), None)
    if peer is None or r["kind"] == "reference":
        return ""
    if r is peer:
        return "1.00x"
    return f"**{common.paired_ratio(peer['times'], r['times']):.2f}x**" if r["kind"] == "gridtrain" else \
        f"{common.paired_ratio(peer['times'], r['times']):.2f}x"


def report(run: common.Run, opts: dict) -> str:
    results = run.results
    r0 = results[0]
    rows = r0["setups"]
    n_mb, mbs, seq = opts["microbatches"], opts["micro_batch_size"], opts["seq_len"]
    tokens = DP * n_mb * mbs * seq
    params = r0["params"]
    lines = common.header(
        run, opts,
        shape=f"{opts['n_layer']} layers, d_model {opts['d_model']}, {opts['n_head']} heads, seq {seq}, vocab 257 "
              f"(table padded to {r0['padded_vocab']}), {params:,} parameters ({mib(4 * params)} in fp32), "
              f"{opts['dtype']}; global batch {DP} ranks x {n_mb} micro-batches x {mbs} sequences = "
              f"{tokens:,} tokens/step",
        threads=f"gloo; dp ranks use {r0['threads_per_rank']} torch thread(s) each (plus gloo's own threads)" +
                (f", the one-process reference {common.reference_threads(opts)}" if opts["reference"] else ""))

    def both(r_index: int, key: str) -> str:
        vals = [res["setups"][r_index]["memory"].get(key) for res in results
                if res["setups"][r_index]["active"]]
        return " / ".join(f"{v / 2**20:.2f}" if v is not None else "?" for v in vals)

    has_keep = any(r["name"] == FSDP_KEEP for r in rows)
    head = "| setup | tokens/s | step ms | best step ms | vs FSDP2 |" + (" vs FSDP2 raf=False |" if has_keep else "")
    lines += [head + " peak MiB (rank 0 / 1) | held MiB (rank 0 / 1) |",
              "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if has_keep else "") + " ---: | ---: |"]
    for i, r in enumerate(rows):
        t = med(r["times"])
        ratios = f" {_pair(rows, r, FSDP)} |" + (f" {_pair(rows, r, FSDP_KEEP)} |" if has_keep else "")
        lines.append(f"| {r['name']} | {tokens / t:,.0f} | {t * 1e3:.1f} | {min(r['times']) * 1e3:.1f} |{ratios} "
                     f"{both(i, 'peak')} | {both(i, 'held')} |")
    peers = "FSDP2" + (" (or FSDP2 reshard_after_forward=False)" if has_keep else "")
    lines += ["", f"vs FSDP2 = tokens/s of the row / tokens/s of {peers}, the median of the per-round ratios "
                  "(> 1: the row is faster)",
              f"memory: live tensor bytes of each side (TensorLedger, see the docstring) in its last warm-up step "
              f"(step {opts['warmup']}): peak during it, held after it; for scale, fp32 params + grads + Adam "
              f"moments = 16 B x {params:,} = {mib(16 * params)} replicated, {mib(16 * params / DP)} fully sharded "
              f"over {DP}"]
    drift = [f"rank {rank} {name}: counted {a:,} B, recounted {b:,} B" for rank, res in enumerate(results)
             for name, (a, b) in res["ledger_drift"].items()]
    lines.append("ledger consistency after the warm-up (running count vs storages' sizes summed afresh): " +
                 ("equal for every owner on both ranks" if not drift else "; ".join(drift)))
    mt = [r for r in rows if "memtracker_peak" in r["memory"]]
    for r in mt:
        m = r["memory"]
        lines.append(f"cross-check, {r['name']} peak in the same step by torch's FSDPMemTracker: "
                     f"{mib(m['memtracker_peak'])} (ledger {mib(m['peak'])})")
    lines += common.per_round("tokens/s per round:", ((r["name"], r["times"]) for r in rows),
                              lambda t: f"{tokens / t:,.0f}")
    lines.append(f"collectives in step {opts['warmup']} (rank 0; calls, whole-tensor bytes):")
    for r in rows:
        if r["kind"] == "reference":
            continue
        comm = r["memory"].get("comm") or {}
        lines.append(f"  {r['name']}: " + (", ".join(f"{k} {c} x = {format_bytes(b)}" for k, (c, b) in
                                                      sorted(comm.items())) or "none"))
    lines += loss_check(rows, opts)
    notes = [n for res in results for n in res["notes"]]
    return "\n".join(lines + common.footer(run, dict.fromkeys(notes)))


def loss_check(rows: list[dict], opts: dict) -> list[str]:
    """Every side starts from the same weights and takes the same steps on the same global
    batch: their losses (and gradient norms) must agree at every step."""
    tol = FP32_TOLERANCE if opts["dtype"] == "fp32" else BF16_TOLERANCE
    ref = next(r for r in rows if r["name"] == FSDP)

    def rel(a: list, b: list) -> float:
        pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
        return max((abs(x - y) / max(abs(y), 1e-30) for x, y in pairs), default=float("nan"))

    diffs = {r["name"]: (rel(r["losses"], ref["losses"]), rel(r["norms"], ref["norms"])) for r in rows if r is not ref}
    worst_loss = max((d for d, _ in diffs.values()), default=0.0)
    agree = all(d <= tol for d, _ in diffs.values())  # False for a NaN too
    parts = [f"{name} {d:.1e}" for name, (d, _) in diffs.items()]
    norm_parts = [f"{name} {n:.1e}" for name, (_, n) in diffs.items()]
    steps = len(ref["losses"])
    timed = opts["repeats"] * opts["steps"]
    verdict = "AGREE" if agree else "DISAGREE"
    return [
        f"loss check over all {steps} steps ({opts['warmup']} warm-up + {timed} timed), every side against "
        f"{FSDP}: {verdict} (largest relative difference {worst_loss:.1e}, bound {tol:g}); per side: "
        + "; ".join(parts),
        f"  {FSDP} losses: first {ref['losses'][0]:.6f}, last {ref['losses'][-1]:.6f}",
        "gradient norms, largest relative difference to FSDP2's over all steps: " + "; ".join(norm_parts),
    ]


def _stage_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ZeRO stages") from None
    if not values or any(v not in STAGES for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: ZeRO stages are 0, 1, 2, 3, each at most once")
    return values


def parse_args(argv: list[str] | None = None) -> dict:
    p = common.benchmark_parser(__doc__, steps=3, warmup=2, repeats=6)
    common.add_micro_batch_arguments(p, microbatches=4, per="rank and step")
    p.add_argument("--zero", type=_stage_list, default=[3, 2],
                   help="comma-separated gridtrain ZeRO stages, one side each (default: 3,2)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="default: %(default)s")
    p.add_argument("--bucket-mb", type=float, default=ParallelConfig.bucket_mb,
                   help="gridtrain's gradient bucket size in MiB (default: gridtrain's, %(default)s)")
    p.add_argument("--no-keep-gathered", dest="keep_gathered", action="store_false",
                   help="skip FSDP2 reshard_after_forward=False and gridtrain --zero 3 --zero3-keep-gathered")
    p.add_argument("--fsdp-adamw", choices=("fused", "foreach", "for-loop"), default="fused",
                   help="torch AdamW implementation on FSDP2's DTensor parameters (default: %(default)s)")
    p.add_argument("--fsdp-grad-sync", choices=("every", "last"), default="every",
                   help="FSDP2 reduce-scatters after every micro-batch (its default) or only the last "
                        "(default: %(default)s)")
    p.add_argument("--reference", dest="reference", action="store_true",
                   help="add the one-process reference (gridtrain, dp 1, on rank 0; default: off)")
    p.set_defaults(reference=False)
    p.add_argument("--no-memtracker", dest="memtracker", action="store_false",
                   help="skip the FSDPMemTracker cross-check of the FSDP2 side's memory")
    opts = common.parse(p, argv, "microbatches")
    if opts["bucket_mb"] <= 0:
        p.error("--bucket-mb must be > 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    return common.benchmark_main("fsdp_vs_torch", argv, parse_args, _configs, DP, _worker, report)


if __name__ == "__main__":
    sys.exit(main())
