"""The dry run: one training step of chosen ranks of an N-rank layout, in this process,
on fake tensors, to measure memory per rank and check device discipline at any scale.

``gridtrain train <flags> --dry-run --world-size N`` runs, for each chosen rank, the
project's own code path: :func:`gridtrain.training.trainer.build` (process groups, model,
pipeline stage, gradient reducer, optimizer) and :meth:`Trainer.train_step` (every
micro-batch's forward and backward in schedule order, the gradient reductions, clipping
and the optimizer step) with micro-batches of token ids made up on the spot (no data set
is read). Nothing is allocated and nothing is communicated:

* tensors are torch's fake tensors (``FakeTensorMode``): they carry shape, dtype and
  device but no data, so gpt2-xl on 1024 ranks costs no memory here;
* the process group is torch's fake one (backend ``"fake"``, ``FakeStore``): rank r of
  N, every collective returns at once. The default group is destroyed and created again
  for each chosen rank, so each rank builds exactly the groups it would build in a job.

What it measures, per rank (``RankMemory``): parameters and their bytes, gradient bytes
(the reducer's flat buffer and any ``.grad`` that is not a view of it), optimizer-state
bytes, the activation peak (bytes saved for backward at once: the same meter as
``--memory-report``, runtime.activation_meter), and the total peak during the step from
:class:`LiveBytes`, a dispatch mode that follows every storage an operation creates until
it is freed, as torch's ``MemTracker`` (torch.distributed._tools.mem_tracker) does.
MemTracker itself is not used: its per-module statistics refuse a module that runs
forward more than once per step, which every micro-batch after the first does. What
these should be is the memory model's (gridtrain/memory/model.py: ``expected_bytes``,
``expected_activation_peak``); the tests and benchmarks/dryrun_memory.py hold the
measurement to it. The same dispatch mode follows the rank's build: its start-up peak
(the model materialised on the meta device's shapes, each rank only its own pieces, the
gradient buffer and the optimizer), ``expected_startup_bytes``'s. It also counts the process groups the rank makes while it is built
(:class:`Communicators`): at 1,024 ranks each is an NCCL communicator to set up, so the
count per rank is a property of the layout worth seeing before a job starts.

What it checks:

* **host synchronisation**: a fake tensor cannot be read, so ``float()``/``int()``/
  ``bool()``/``.item()`` on device data inside the step raises. The step's deliberate
  reads are named points (:mod:`gridtrain.runtime.host_sync`); the dry run lets those through with
  a stand-in value and reports which were hit; any other read fails the dry run with its
  call site;
* **device discipline**: every tensor handed to a collective or point-to-point operation
  must be on the rank's device (NCCL takes only GPU tensors; gloo forgives CPU ones). A
  dispatch mode sees each ``c10d`` operation and raises :class:`DeviceDisciplineError`
  naming the line (outside torch) that issued it.

Patches, all undone on exit and all here (:func:`_patched`):

* ``gridtrain.runtime.watchdog.start_watchdog`` does nothing: the hang watchdog would start a
  thread polling a store that no other rank writes;
* ``torch.utils.swap_tensors`` first clears the fake mode's memo of converted tensors:
  ``Module.to`` swaps fake parameters in place (never ``.data =``, as for real ones),
  which torch refuses while a weak reference (that memo's) points at them; and it gives
  the new tensor the old one's attributes first, since a swap exchanges ``__dict__`` and
  the parameters' ``tp_spec``, ``tied_copy``, ``sequence_parallel`` would be lost;
* ``torch.set_rng_state`` ignores a fake state: the TP tracker's stream states are
  clones, made under the fake mode, of real generator states, and fake random
  operations draw nothing from any generator anyway;
* for ``cuda``: ``torch.cuda.set_device`` does nothing, and the CUDA generator's state
  (``get_rng_state``/``set_rng_state``/``manual_seed``) is a CPU byte tensor kept here,
  because none of these can run without a GPU.

**Where there is no GPU** (a cluster's login node, CI) torch's autograd cannot run on
fake CUDA tensors (its engine looks up each device's streams, which needs a driver), and
a CPU build of torch cannot even slice them. The step then runs twice
(:class:`DryRunDevices`): on fake CUDA tensors without the backward (a CUDA build only:
construction, forwards, gradient reductions, clipping, the optimizer step, parameter
gathers and publishes), held to the CUDA rules of :mod:`gridtrain.runtime.cuda_rules`
(no tensor made on the host, no blocking host-to-device copy, no ``non_blocking`` copy
read before a wait), with ``torch.cuda``'s events and streams replaced by host stand-ins;
then whole on fake CPU tensors, for the backward and the memory figures, with each
kernel whose CUDA shape rules differ from the CPU's (``_scaled_mm``, ``_grouped_mm``)
also run on fake CUDA tensors of the same shapes (:class:`~gridtrain.runtime.cuda_rules.CudaKernelShapes`).
The command's first line says which. With a GPU the step runs once, on fake CUDA, under
the same rules. ``--fp8`` runs the float8 GEMMs as a GPU does (``torch._scaled_mm``'s
meta function), not emulated.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
import traceback
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from gridtrain.runtime import host_sync
from gridtrain.runtime import activation_meter, watchdog
from gridtrain.runtime.cuda_rules import CudaKernelShapes, CudaRuleError, CudaRules, call_site, fake_cuda_runtime, tensors
from gridtrain.config import Config, ConfigError
from gridtrain.parallel.grid import ProcessGrid
from gridtrain.parallel.zero3 import whole_shape


class DeviceDisciplineError(CudaRuleError):
    """A tensor on the wrong device was handed to a collective or P2P operation."""


class UnnamedHostSync(CudaRuleError):
    """The step read device data on the host outside a named point (host_sync.py)."""


@dataclass
class RankMemory:
    """One dry-run rank: where it sits and what it holds (bytes on its device)."""

    rank: int
    dp: int
    pp: int
    tp: int
    parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    peak_bytes: int
    sync_points: list[str] = field(default_factory=list)  # named host reads the step made
    seconds: float = 0.0
    cp: int = 0
    communicators: dict[str, int] = field(default_factory=dict)  # Communicators of the build, as a dict
    startup_peak_bytes: int = 0  # the peak while the rank was built (memory.model.expected_startup_bytes)


@dataclass
class Communicators:
    """The process groups one rank asked torch for: ``created`` counts the group-making
    calls (``new_group``, ``split_group``) made on the rank, ``member`` those that gave it
    a group of more than one rank. On GPUs each group is a communicator to set up, and a
    call a non-member must make too is a collective over the world."""

    created: int = 0
    member: int = 0


@contextlib.contextmanager
def counting_communicators():
    """Count the group-making calls made inside the block (see :class:`Communicators`)."""
    counts = Communicators()
    makers = {name: getattr(dist, name) for name in ("new_group", "split_group") if hasattr(dist, name)}

    def counted(make):
        def call(*args, **kwargs):
            group = make(*args, **kwargs)
            counts.created += 1
            counts.member += (group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER
                              and dist.get_world_size(group) > 1)
            return group
        return call

    for name, make in makers.items():
        setattr(dist, name, counted(make))
    try:
        yield counts
    finally:
        for name, make in makers.items():
            setattr(dist, name, make)


# ---- which ranks ---------------------------------------------------------------------------------

def choose_ranks(grid: ProcessGrid, spec: str) -> list[int]:
    """``edges``: DP/TP rank 0 of the first, a middle and the last pipeline stage (where
    the embedding, a plain stage and the head live, and where 1F1B keeps the most and
    the fewest micro-batches); ``all``; or a comma-separated list of ranks."""
    if spec == "edges":
        stages = sorted({0, grid.pp // 2, grid.pp - 1})
        return [grid.rank_of(0, s, 0) for s in stages]
    if spec == "all":
        return list(range(grid.world_size))
    try:
        ranks = [int(r) for r in spec.split(",")]
    except ValueError:
        raise ConfigError(f"--dry-run-ranks {spec!r}: use edges, all, or ranks like 0,5,9") from None
    bad = [r for r in ranks if not 0 <= r < grid.world_size]
    if bad:
        raise ConfigError(f"--dry-run-ranks: rank(s) {bad} outside [0, {grid.world_size}); pick ranks below "
                          f"--world-size")
    return list(dict.fromkeys(ranks))


@dataclass(frozen=True)
class DryRunDevices:
    """Where the dry run runs a rank's step. ``device``: the layout's device. ``autograd``:
    whether autograd can run on fake tensors of it: on ``cpu`` always; on ``cuda`` only
    where a GPU is visible (torch's autograd engine looks up each device's streams, which
    needs a driver). ``cpu_build``: this torch has no CUDA kernels (fake CUDA tensors can
    be made there, but not sliced). A cuda layout without autograd runs its step on fake
    CPU tensors for the memory figures, held to CUDA's kernel shape rules
    (cuda_rules.CudaKernelShapes); with a CUDA build, first also on fake CUDA tensors
    without the backward (construction, forwards, gradient reductions, clipping, the
    optimizer step and parameter gathers, under the CUDA rules of runtime/cuda_rules.py)."""

    device: str
    autograd: bool = True
    cpu_build: bool = False

    @property
    def split(self) -> bool:
        return self.device == "cuda" and not self.autograd

    def describe(self) -> str:
        if not self.split:
            return f"device {self.device}"
        if self.cpu_build:
            return ("device cuda (a CPU build of torch: the step on fake cpu under CUDA's kernel shape rules; a "
                    "CUDA build of torch also runs it on fake cuda)")
        return ("device cuda (no GPU here: construction, forwards, gradient reductions and the optimizer step on "
                "fake cuda; the backward and the memory figures on fake cpu, under CUDA's kernel shape rules)")


def dry_run_device(requested: str | None) -> DryRunDevices:
    """cuda by default where torch is a CUDA build, else cpu; ``--device cuda`` on a CPU
    build runs what it can on fake CUDA (:class:`DryRunDevices`)."""
    cuda_built = torch.backends.cuda.is_built()
    device = requested or ("cuda" if cuda_built else "cpu")
    if device != "cuda":
        return DryRunDevices(device)
    return DryRunDevices("cuda", autograd=cuda_built and torch.cuda.is_available(), cpu_build=not cuda_built)


# ---- patches -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _patched(fake_mode, device_type: str):
    """What the real step needs that a fake world lacks (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    original_swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        # swapping exchanges __dict__: carry the parameter's own marks (tp_spec, tied_copy,
        # ...) over, but not the fake tensor's (fake_device: a copy to cuda stayed on cpu)
        for key, value in t1.__dict__.items():
            t2.__dict__.setdefault(key, value)
        return original_swap(t1, t2)

    patch(torch.utils, "swap_tensors", swap_tensors)
    patch(watchdog, "start_watchdog", lambda *args, **kwargs: None)
    original_set_rng_state = torch.set_rng_state

    def set_rng_state(state):
        if not isinstance(state, FakeTensor):
            original_set_rng_state(state)

    patch(torch, "set_rng_state", set_rng_state)
    if device_type == "cuda":
        states: dict[int, torch.Tensor] = {}

        def index(device=None) -> int:
            device = torch.device("cuda", 0) if device is None else torch.device(device)
            return 0 if device.index is None else device.index

        blank = torch.zeros(16, dtype=torch.uint8)  # made before any step: a host tensor by design

        def get_rng_state(device="cuda"):
            return states.get(index(device), blank).clone()

        def set_rng_state(state, device="cuda"):
            states[index(device)] = state.clone()

        def manual_seed(seed):
            states[0] = torch.tensor(list(int(seed).to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)

        real_count = torch.cuda.device_count()
        patch(torch.cuda, "device_count", lambda: max(1, real_count))  # this rank's cuda:0 without a GPU
        patch(torch.cuda, "set_device", lambda device: None)
        patch(torch.cuda, "get_rng_state", get_rng_state)
        patch(torch.cuda, "set_rng_state", set_rng_state)
        patch(torch.cuda, "manual_seed", manual_seed)
    runtime = fake_cuda_runtime() if device_type == "cuda" else contextlib.nullcontext()
    try:
        with runtime:
            yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


class _CollectiveDevices(TorchDispatchMode):
    """Raise when a ``c10d`` operation gets a tensor that is not on ``device``."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self.calls += 1
            for t in tensors((args, kwargs)):
                if t.device.type != self.device.type:
                    raise DeviceDisciplineError(f"{func.name()} got a {t.device.type} tensor {tuple(t.shape)} "
                                                f"{t.dtype} on a {self.device.type} rank, at {_call_site()}")
        return func(*args, **kwargs)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive on ``device_type`` and their peak: every storage an
    operation outputs (and any given to :meth:`track`) is counted once until it is freed
    (a weak reference's callback). Storage bytes, without the caching allocator's
    rounding, so that the figure is a property of the step, not of the allocator."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.current = self.peak = 0

    def track(self, *given) -> None:
        for t in tensors(list(given)):
            if t.device.type != self.device_type:
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self.live:
                continue
            self.live[key] = st.nbytes()
            self.current += st.nbytes()
            self.refs[key] = weakref.ref(st, lambda _, key=key: self._free(key))
        self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


def _call_site() -> str:
    return call_site(skip=(__file__,))


# ---- one rank -------------------------------------------------------------------------------------

def _fake_batches(cfg: Config, trainer) -> list[dict[str, torch.Tensor]] | None:
    """Micro-batches of token ids on the stages that embed or compute the loss, made up
    on the TP group's first rank (on the host, as a dataset gives them) and passed to the
    others as trainer.read_micro_batches does (tensor_parallel.broadcast_batches)."""
    from gridtrain.parallel.tensor_parallel import broadcast_batches
    from gridtrain.training.trainer import batch_shapes, own_chunks

    ctx, masked = trainer.ctx, cfg.data.document_mask  # with document masks every stage reads them
    if not (masked or ctx.grid.is_first_stage(ctx.rank) or ctx.grid.is_last_stage(ctx.rank)):
        return None
    n, shape = trainer.num_micro_batches, (cfg.training.micro_batch_size, cfg.model.seq_len)
    batches = None
    if ctx.tp.rank == 0:
        batches = [{k: torch.randint(0, cfg.model.vocab_size, shape).to(ctx.device) for k in ("tokens", "labels")}
                   for _ in range(n)]
        for b in batches:  # four documents per sequence
            if masked:
                b["documents"] = (torch.arange(shape[1]) * 4 // shape[1]).expand(shape).to(ctx.device)
    return own_chunks(broadcast_batches(batches, n, ctx.tp, ctx.device, batch_shapes(cfg)), ctx)


def _storages(tensors) -> dict[int, int]:
    """Bytes per distinct storage (views of one buffer count once)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out[st._cdata] = st.nbytes()
    return out


def measure_step(trainer, batches, *, fake: bool = True, backward: bool = True,
                 rules: CudaRules | None = None) -> RankMemory:
    """One ``train_step`` of ``trainer`` under the meters, and what the rank holds after
    it. The same for fake tensors (the dry run) and real ones (tests compare the two;
    ``fake=False``: the named host reads return the real values). ``backward=False``:
    the schedule's backward actions do nothing (fake CUDA without a GPU). ``rules``: the
    CUDA rules the step is held to; a breach raises :class:`CudaRuleError`."""
    from gridtrain.parallel.pipeline import runtime as pipeline_runtime

    ctx, model = trainer.ctx, trainer.model
    meter = activation_meter.ActivationMeter.for_model(model)
    tracker = LiveBytes(ctx.device.type)
    shards = trainer.param_shards.held_tensors() if trainer.param_shards is not None else []
    tracker.track(list(model.parameters()), list(model.buffers()), *trainer.reducer.held_tensors(), *shards,
                  trainer.optimizer.state_tensors())
    trainer.set_lr(0)
    syncs = host_sync.allowing() if fake else contextlib.nullcontext([])
    skip = contextlib.ExitStack()
    if not backward:
        skip.enter_context(_replaced(pipeline_runtime.PipelineStage, "_backward", _no_backward))
    with skip, tracker, _CollectiveDevices(ctx.device), activation_meter.saved_activations(meter), syncs as hits, \
            rules or contextlib.nullcontext():
        trainer.train_step(batches)
    if rules is not None and rules.breaches:
        unique = list(dict.fromkeys(str(b) for b in rules.breaches))
        raise CudaRuleError(f"rank {ctx.rank}: the step broke {len(unique)} CUDA rule(s):\n  " + "\n  ".join(unique))
    params = list(model.parameters())
    shards = trainer.param_shards.held_tensors() if trainer.param_shards is not None else []
    param_storages = _storages(params + shards)  # ZeRO-3: the parameter shard (the parameters are empty)
    grads = _storages(trainer.reducer.held_tensors()
                      + [p.grad for p in params if p.grad is not None])
    for key in param_storages:
        grads.pop(key, None)
    # the device's (--optimizer-offload keeps the state in host memory)
    optim = _storages([t for t in trainer.optimizer.state_tensors() if t.device.type == ctx.device.type])
    for key in param_storages:  # fp32 ZeRO-3: the master weights are the parameter shard
        optim.pop(key, None)
    c = ctx.coords
    return RankMemory(rank=ctx.rank, dp=c.dp, pp=c.pp, tp=c.tp, cp=c.cp, parameters=sum(math.prod(whole_shape(p)) for p in params),
                      parameter_bytes=sum(param_storages.values()), gradient_bytes=sum(grads.values()),
                      optimizer_bytes=sum(optim.values()), activation_peak_bytes=meter.peak_bytes,
                      peak_bytes=tracker.peak, sync_points=sorted(set(hits)))


def _no_backward(stage, mb: int, chunk: int) -> None:
    """A pipeline stage's backward action without autograd: its output is dropped and the
    gradient it would send back is a stand-in of its input's shape."""
    stage.outputs.pop((mb, chunk))
    if not stage._is_last(chunk):
        stage.grads.pop((mb, chunk))
    x = stage.inputs.get((mb, chunk))
    if x is not None:
        x.grad = torch.zeros_like(x)
    stage.recompute.forget((mb, chunk))
    stage.in_flight -= 1


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def run_rank(cfg: Config, world_size: int, rank: int, devices: DryRunDevices | str) -> RankMemory:
    """Build rank ``rank`` of the layout and run one step on fake tensors: on
    ``devices.device``, or, split (:class:`DryRunDevices`), first without the backward on
    fake CUDA, then whole on fake CPU for the memory figures."""
    devices = DryRunDevices(devices) if isinstance(devices, str) else devices
    if devices.split:
        if not devices.cpu_build:
            _run_rank(cfg, world_size, rank, devices)
        return _run_rank(cfg, world_size, rank, DryRunDevices("cpu"), kernel_shapes=True)
    return _run_rank(cfg, world_size, rank, devices)


def _run_rank(cfg: Config, world_size: int, rank: int, devices: DryRunDevices,
              kernel_shapes: bool = False) -> RankMemory:
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
    from gridtrain.training.trainer import build

    began = time.perf_counter()
    device_type = devices.device
    cfg = copy.deepcopy(cfg)
    cfg.training.device = device_type
    cfg.parallel.nproc = None
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # real inputs allowed: the RNG states that recomputation captures and replays
        # (torch.get_rng_state) are real host tensors, by design
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        cuda = device_type == "cuda"
        with _patched(fake, device_type), fake, counting_communicators() as communicators:
            # the build may copy between the host and the device as it likes (a CPU build
            # of torch needs those copies answered: the rules do that)
            with LiveBytes(device_type) as startup:  # the model materialised, the optimizer made
                trainer = build(cfg, decoder_model_provider, decoder_forward_step)
            fp8 = getattr(trainer.ctx.tp, "fp8", None)
            if fp8 is not None:  # the GEMMs as the GPU runs them: torch's meta checks their shapes
                fp8.emulate = False
            try:
                batches = _fake_batches(cfg, trainer)
                rules = CudaRules() if cuda else None
                with CudaKernelShapes() if kernel_shapes else contextlib.nullcontext():
                    result = measure_step(trainer, batches, backward=devices.autograd, rules=rules)
            except DataDependentOutputException as e:
                raise UnnamedHostSync(f"rank {rank}: the step read device data on the host outside a named "
                                      f"sync point ({e}); at {_host_read_site(e)}") from e
        result.seconds = time.perf_counter() - began
        result.communicators = asdict(communicators)
        result.startup_peak_bytes = startup.peak
        return result
    finally:
        dist.destroy_process_group()


def _host_read_site(error: BaseException) -> str:
    """The innermost frame outside torch of the traceback that read a fake tensor."""
    return call_site(traceback.extract_tb(error.__traceback__), skip=(__file__,))


# ---- the command ----------------------------------------------------------------------------------

def dry_run(cfg: Config, world_size: int, ranks: str = "edges", report: str | None = None,
            out=print) -> dict:
    """Run the chosen ranks; print a table; write the JSON report; return it."""
    p = cfg.parallel
    grid = ProcessGrid.build(world_size, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    devices = dry_run_device(cfg.training.device)
    chosen = choose_ranks(grid, ranks)
    out(f"dry run: {grid.describe()}, ranks {chosen}, {devices.describe()} (fake tensors, fake process group)")
    results = []
    for r in chosen:
        began = time.perf_counter()
        results.append(run_rank(cfg, world_size, r, devices))
        results[-1].seconds = time.perf_counter() - began
    for line in table_lines(results):
        out(line)
    data = {"world_size": world_size, "ranks": [asdict(r) for r in results]}
    if report:
        Path(report).write_text(json.dumps(data, indent=1) + "\n")
        out(f"wrote {report}")
    return data


def table_lines(results: list[RankMemory]) -> list[str]:
    gib = lambda n: f"{n / 2**20:10.1f}"  # noqa: E731
    lines = [f"{'rank':>6} {'dp':>4} {'pp':>3} {'cp':>3} {'tp':>3} {'parameters':>13} {'params MiB':>10} {'grads MiB':>10} "
             f"{'optim MiB':>10} {'act peak MiB':>12} {'peak MiB':>10} {'startup MiB':>11} {'groups':>7} {'s':>6}  host syncs"]
    for r in results:
        groups = f"{r.communicators.get('created', 0)}/{r.communicators.get('member', 0)}"
        lines.append(f"{r.rank:>6} {r.dp:>4} {r.pp:>3} {r.cp:>3} {r.tp:>3} {r.parameters:>13,} {gib(r.parameter_bytes):>10} "
                     f"{gib(r.gradient_bytes)} {gib(r.optimizer_bytes)} {gib(r.activation_peak_bytes):>12} "
                     f"{gib(r.peak_bytes)} {gib(r.startup_peak_bytes):>11} {groups:>7} {r.seconds:6.1f}  "
                     f"{','.join(r.sync_points)}")
    lines.append("groups: process-group creating calls the rank made (new_group, split_group) / those that "
                 "gave it a group of more than one rank")
    return lines
