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
``--memory-report``, memory.ActivationMeter), and the total peak during the step from
:class:`LiveBytes`, a dispatch mode that follows every storage an operation creates until
it is freed, as torch's ``MemTracker`` (torch.distributed._tools.mem_tracker) does.
MemTracker itself is not used: its per-module statistics refuse a module that runs
forward more than once per step, which every micro-batch after the first does.

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

Fake CUDA tensors need a CUDA build of torch (no GPU): on a CPU-only build autograd
cannot record a graph on them (its per-device stream lookup has no CUDA
implementation), so there ``--device cuda`` is refused with one line and the dry run
defaults to ``cpu``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import traceback
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from gridtrain.runtime import host_sync
from gridtrain.memory import activations as memory
from gridtrain.runtime import watchdog
from gridtrain.config import Config, ConfigError
from gridtrain.parallel.grid import ProcessGrid


class DeviceDisciplineError(RuntimeError):
    """A tensor on the wrong device was handed to a collective or P2P operation."""


class UnnamedHostSync(RuntimeError):
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


def dry_run_device(requested: str | None) -> str:
    """cuda by default where torch can make fake CUDA tensors (a CUDA build), else cpu."""
    cuda_built = torch.backends.cuda.is_built()
    if requested == "cuda" and not cuda_built:
        raise ConfigError("--dry-run --device cuda needs a CUDA build of torch (no GPU needed); this torch "
                          f"({torch.__version__}) is CPU-only: use --device cpu")
    return requested or ("cuda" if cuda_built else "cpu")


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
        t2.__dict__.update(t1.__dict__)  # swapping exchanges __dict__: keep tp_spec, tied_copy, ...
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

        def get_rng_state(device="cuda"):
            return states.setdefault(index(device), torch.zeros(16, dtype=torch.uint8)).clone()

        def set_rng_state(state, device="cuda"):
            states[index(device)] = state.clone()

        def manual_seed(seed):
            states[0] = torch.tensor(list(int(seed).to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)

        patch(torch.cuda, "set_device", lambda device: None)
        patch(torch.cuda, "get_rng_state", get_rng_state)
        patch(torch.cuda, "set_rng_state", set_rng_state)
        patch(torch.cuda, "manual_seed", manual_seed)
    try:
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
            for t in _tensors((args, kwargs)):
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

    def track(self, *tensors) -> None:
        for t in _tensors(list(tensors)):
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


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _call_site() -> str:
    """The innermost frame outside torch and this module: who issued the operation."""
    return _innermost(traceback.extract_stack())


def _innermost(frames) -> str:
    torch_dir = str(Path(torch.__file__).parent)
    for frame in reversed(frames):
        if not frame.filename.startswith(torch_dir) and frame.filename != __file__ \
                and "contextlib" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "unknown"


# ---- one rank -------------------------------------------------------------------------------------

def _fake_batches(cfg: Config, trainer) -> list[dict[str, torch.Tensor]] | None:
    """Micro-batches of token ids on the stages that embed or compute the loss, made up
    on the TP group's first rank (on the host, as a dataset gives them) and passed to the
    others as trainer.read_micro_batches does (tensor_parallel.broadcast_batches)."""
    from gridtrain.parallel.tensor_parallel import broadcast_batches
    from gridtrain.training.trainer import batch_shapes

    ctx = trainer.ctx
    if not (ctx.grid.is_first_stage(ctx.rank) or ctx.grid.is_last_stage(ctx.rank)):
        return None
    n, shape = trainer.num_micro_batches, (cfg.training.micro_batch_size, cfg.model.seq_len)
    batches = None
    if ctx.tp.rank == 0:
        batches = [{k: torch.randint(0, cfg.model.vocab_size, shape).to(ctx.device) for k in ("tokens", "labels")}
                   for _ in range(n)]
    return broadcast_batches(batches, n, ctx.tp, ctx.device, batch_shapes(cfg))


def _storages(tensors) -> dict[int, int]:
    """Bytes per distinct storage (views of one buffer count once)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out[st._cdata] = st.nbytes()
    return out


def measure_step(trainer, batches, *, fake: bool = True) -> RankMemory:
    """One ``train_step`` of ``trainer`` under the meters, and what the rank holds after
    it. The same for fake tensors (the dry run) and real ones (tests compare the two;
    ``fake=False``: the named host reads return the real values)."""
    ctx, model = trainer.ctx, trainer.model
    meter = memory.ActivationMeter.for_model(model)
    tracker = LiveBytes(ctx.device.type)
    tracker.track(list(model.parameters()), list(model.buffers()), trainer.reducer.buffer,
                  trainer.optimizer.state_tensors())
    trainer.set_lr(0)
    syncs = host_sync.allowing() if fake else contextlib.nullcontext([])
    with tracker, _CollectiveDevices(ctx.device), memory.saved_activations(meter), syncs as hits:
        trainer.train_step(batches)
    params = list(model.parameters())
    param_storages = _storages(params)
    grads = _storages([trainer.reducer.buffer, trainer.reducer.shard_grad]
                      + [p.grad for p in params if p.grad is not None])
    for key in param_storages:
        grads.pop(key, None)
    optim = _storages(trainer.optimizer.state_tensors())
    c = ctx.coords
    return RankMemory(rank=ctx.rank, dp=c.dp, pp=c.pp, tp=c.tp, parameters=sum(p.numel() for p in params),
                      parameter_bytes=sum(param_storages.values()), gradient_bytes=sum(grads.values()),
                      optimizer_bytes=sum(optim.values()), activation_peak_bytes=meter.peak_bytes,
                      peak_bytes=tracker.peak, sync_points=sorted(set(hits)))


def run_rank(cfg: Config, world_size: int, rank: int, device_type: str) -> RankMemory:
    """Build rank ``rank`` of the layout and run one step on fake tensors."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gridtrain.training.providers import decoder_forward_step, decoder_model_provider
    from gridtrain.training.trainer import build

    began = time.perf_counter()
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
        with _patched(fake, device_type), fake:
            trainer = build(cfg, decoder_model_provider, decoder_forward_step)
            try:
                result = measure_step(trainer, _fake_batches(cfg, trainer))
            except DataDependentOutputException as e:
                raise UnnamedHostSync(f"rank {rank}: the step read device data on the host outside a named "
                                      f"sync point ({e}); at {_host_read_site(e)}") from e
            result.seconds = time.perf_counter() - began
            return result
    finally:
        dist.destroy_process_group()


def _host_read_site(error: BaseException) -> str:
    """The innermost frame outside torch of the traceback that read a fake tensor."""
    return _innermost(traceback.extract_tb(error.__traceback__))


# ---- closed forms ----------------------------------------------------------------------------------

def stage_layers(cfg: Config, grid: ProcessGrid, stage: int) -> list[tuple[tuple[int, ...], bool, bool]]:
    """(block ids, embeds, ends) of each model chunk of pipeline stage ``stage``, from the
    partition alone (uniform, parameters or --pp-layers; not the measured ``time``)."""
    from gridtrain.training.providers import unit_costs
    from gridtrain.parallel.pipeline.partition import partition

    p, v = grid.pp, cfg.parallel.vpp
    explicit = cfg.parallel.pp_layers
    if explicit is None and cfg.parallel.pp_partition == "time":
        raise ValueError("no closed form for --pp-partition time (measured)")
    costs = None if explicit is not None else unit_costs(cfg, cfg.parallel.pp_partition)
    layers = partition(cfg.model.n_layer, p * v, explicit=explicit, costs=costs)
    return [(tuple(layers[c * p + stage]), c * p + stage == 0, c * p + stage == p * v - 1) for c in range(v)]


def expected_parameters(cfg: Config, grid: ProcessGrid, rank: int) -> int:
    """Parameters rank ``rank`` holds, from the model's shape and the layout: per block
    (model.block_parameters), GPT-2's column-parallel QKV and MLP expansion (weights and
    biases / t), row-parallel projections (weights / t, whole biases), whole LayerNorms,
    or Llama's q, proj, gate, up, down / t, the rank's whole key/value heads and two
    whole RMSNorms; the vocabulary-parallel token table (padded vocabulary / t rows) and
    GPT-2's whole position table on the first stage; the final norm and, unless the
    stage also embeds, a copy of the (tied) table or the untied head on the last."""
    from gridtrain.models.decoder import block_parameters

    m, t = cfg.model, grid.tp
    d = m.d_model
    table = m.padded_vocab_size(t) // t * d
    chunks = stage_layers(cfg, grid, grid.coords(rank).pp)
    embeds, ends = any(c[1] for c in chunks), any(c[2] for c in chunks)
    n = block_parameters(m, t) * sum(len(c[0]) for c in chunks)
    gpt2 = m.arch == "gpt2"
    if embeds:
        n += table + (m.seq_len * d if gpt2 else 0)
    if ends:
        n += (2 * d if gpt2 else d) + (table if not (m.tie_embeddings and embeds) else 0)
    return n


def expected_bytes(cfg: Config, grid: ProcessGrid, rank: int) -> dict[str, int]:
    """parameter, gradient and optimizer bytes of a rank, as the code allocates them:

    * parameters in the run's dtype;
    * gradients: the reducer's flat buffer (fp32 for 16-bit parameters, else the
      parameters' dtype); with ZeRO-1 padded to a multiple of dp (:func:`_padded_buffer`),
      plus this rank's reduce-scattered 1/dp slice of it;
    * optimizer: torch's AdamW (fp32/fp64 without ZeRO) keeps two moments per parameter
      and a 4-byte step count per parameter tensor; the flat optimizer (16-bit or ZeRO-1)
      keeps master weights and two moments for its slice (all of it without ZeRO) and
      nothing else (``DistributedOptimizer.state_bytes``)."""
    n = expected_parameters(cfg, grid, rank)
    from gridtrain.parallel.distributed import TORCH_DTYPES

    t = cfg.training
    dtype = TORCH_DTYPES[t.dtype]
    e = dtype.itemsize
    wide = 8 if dtype == torch.float64 else 4  # gradient buffer and master weights
    padded = _padded_buffer(cfg, grid, rank, n) if cfg.parallel.zero == 1 else n
    grads = padded * wide + (padded // grid.dp * wide if cfg.parallel.zero == 1 else 0)
    if cfg.parallel.zero == 0 and dtype in (torch.float32, torch.float64):
        tensors = _parameter_tensors(cfg, grid, rank)
        optim = 2 * n * e + 4 * tensors
    else:
        owned = padded // grid.dp if cfg.parallel.zero == 1 else n
        optim = 3 * owned * wide
    return {"parameters": n, "parameter_bytes": n * e, "gradient_bytes": grads, "optimizer_bytes": optim}


def _padded_buffer(cfg: Config, grid: ProcessGrid, rank: int, n: int) -> int:
    """ZeRO-1's gradient buffer (data_parallel.bucket_bounds): padded to a multiple of dp
    at its end, and a token table tied across pipeline stages in a bucket padded on its
    own (on the first and last stage)."""
    def up(x: int) -> int:
        return -(-x // grid.dp) * grid.dp

    chunks = stage_layers(cfg, grid, grid.coords(rank).pp)
    m = cfg.model
    if m.tie_embeddings and grid.pp > 1 and any(c[1] or c[2] for c in chunks):
        table = m.padded_vocab_size(grid.tp) // grid.tp * m.d_model
        return up(n - table) + up(table)
    return up(n)


def _parameter_tensors(cfg: Config, grid: ProcessGrid, rank: int) -> int:
    """Parameter tensors of a rank (AdamW keeps one step count per tensor)."""
    chunks = stage_layers(cfg, grid, grid.coords(rank).pp)
    embeds, ends = any(c[1] for c in chunks), any(c[2] for c in chunks)
    gpt2 = cfg.model.arch == "gpt2"
    # GPT-2: 2 LayerNorms x 2, 4 linears x (weight, bias); Llama: 2 RMSNorms, 7 linears
    n = (12 if gpt2 else 9) * sum(len(c[0]) for c in chunks)
    n += (2 if gpt2 else 1) if embeds else 0  # token (and position) table
    n += ((2 if gpt2 else 1) + (0 if cfg.model.tie_embeddings and embeds else 1)) if ends else 0
    return n


def expected_activation_peak(cfg: Config, grid: ProcessGrid, rank: int, device_type: str) -> float:
    """The formula's activation peak of a stage: the schedule's action list walked, each
    F adding and each B removing its chunk's bytes: the per-block bytes of
    memory.korthikanti_bytes (docs/memory.md) summed over the chunk's blocks, plus, for
    the chunk that ends the model, the head (the loss's fp32 softmax over the vocabulary
    slice dominates it); with full recomputation plus one region's rebuilt activations
    (held transiently in backward), with selective recomputation plus what one block's
    rebuilt attention core holds beyond what its backward has released
    (memory.rebuilt_core_bytes), and for the chunk that embeds, the token ids,
    positions and dropout mask of the embedding.
    Describes ``--attention math`` (the fused kernel keeps no s x s scores) and
    ``--recompute-keep-last`` off."""
    from gridtrain.parallel.distributed import TORCH_DTYPES
    from gridtrain.parallel.pipeline.schedules import B, F, build_schedule
    from gridtrain.parallel.recompute import policy_from

    m, t = cfg.model, cfg.training
    e = TORCH_DTYPES[t.dtype].itemsize
    sp = cfg.parallel.sequence_parallel and grid.tp > 1
    shape = memory.layer_shape(m, batch=t.micro_batch_size, tp=grid.tp, sequence_parallel=sp, element_bytes=e,
                               mask_bytes=memory.dropout_mask_bytes(torch.device(device_type), e))
    stage = grid.coords(rank).pp
    micro_batches = t.global_batch_size // (t.micro_batch_size * grid.dp)
    actions = build_schedule(cfg.parallel.schedule, grid.pp, micro_batches, cfg.parallel.vpp)[stage]
    policy = policy_from(cfg.activations)
    chunks = stage_layers(cfg, grid, stage)
    tokens = m.seq_len * t.micro_batch_size
    # the loss: the softmax over this rank's vocabulary slice in fp32 (kept by the cross
    # entropy for backward), the target index (int64) and two flags per token; the final
    # norm's input and the head's input (a sequence shard under SP)
    head = tokens * (m.padded_vocab_size(grid.tp) // grid.tp * 4 + 8 + 2) \
        + 2 * tokens * m.d_model * e / (grid.tp if sp else 1)
    # the embedding: the token ids and positions its lookups keep (int64), under TP the
    # shifted ids and the out-of-range flags, and with dropout the mask
    sp_div = grid.tp if sp else 1
    positions = m.seq_len // sp_div * 8 if m.arch == "gpt2" else 0  # Llama's are rotary (no lookup)
    embedding = tokens * 8 + positions + (tokens * 9 if grid.tp > 1 else 0) \
        + (tokens * m.d_model * shape["mask_bytes"] / sp_div if m.dropout > 0 else 0.0)
    cost = [sum(memory.expected_by_layer(policy.block_runs(ids), policy.mode, micro_batches, False,
                                         **shape).values()) + (head if ends else 0.0) + (embedding if embeds else 0.0)
            for ids, embeds, ends in chunks]
    # with full recomputation, B rebuilds one region (the longest) on top of what is held;
    # its input is already counted (kept), and on the chunk that ends the model the
    # head's backward has released the softmax by then
    region = max((len(r) for ids, _, _ in chunks for r, redo in policy.block_runs(ids) if redo), default=0)
    rebuilt = [region * memory.korthikanti_bytes(recompute="none", **shape)
               - memory.korthikanti_bytes(recompute="full", **shape) - (head if ends else 0.0)
               if region else 0.0 for _, _, ends in chunks]
    if policy.mode == "selective":  # B rebuilds one block's attention core at a time
        rebuilt = [max(0.0, memory.rebuilt_core_bytes(**shape) - (head if ends else 0.0)) if ids else 0.0
                   for ids, _, ends in chunks]
    held = peak = 0.0
    for a in actions:  # what the schedule holds between each F and its B, chunk by chunk
        if a.kind == F:
            held += cost[a.chunk]
            peak = max(peak, held)
        elif a.kind == B:
            peak = max(peak, held + rebuilt[a.chunk])
            held -= cost[a.chunk]
    return peak


# ---- the command ----------------------------------------------------------------------------------

def dry_run(cfg: Config, world_size: int, ranks: str = "edges", report: str | None = None,
            out=print) -> dict:
    """Run the chosen ranks; print a table; write the JSON report; return it."""
    p = cfg.parallel
    grid = ProcessGrid.build(world_size, tp=p.tp, pp=p.pp, dp=p.dp)
    device_type = dry_run_device(cfg.training.device)
    chosen = choose_ranks(grid, ranks)
    out(f"dry run: {grid.describe()}, ranks {chosen}, device {device_type} (fake tensors, fake process group)")
    results = [run_rank(cfg, world_size, r, device_type) for r in chosen]
    for line in table_lines(results):
        out(line)
    data = {"world_size": world_size, "ranks": [asdict(r) for r in results]}
    if report:
        Path(report).write_text(json.dumps(data, indent=1) + "\n")
        out(f"wrote {report}")
    return data


def table_lines(results: list[RankMemory]) -> list[str]:
    gib = lambda n: f"{n / 2**20:10.1f}"  # noqa: E731
    lines = [f"{'rank':>6} {'dp':>4} {'pp':>3} {'tp':>3} {'parameters':>13} {'params MiB':>10} {'grads MiB':>10} "
             f"{'optim MiB':>10} {'act peak MiB':>12} {'peak MiB':>10} {'s':>6}  host syncs"]
    for r in results:
        lines.append(f"{r.rank:>6} {r.dp:>4} {r.pp:>3} {r.tp:>3} {r.parameters:>13,} {gib(r.parameter_bytes):>10} "
                     f"{gib(r.gradient_bytes)} {gib(r.optimizer_bytes)} {gib(r.activation_peak_bytes):>12} "
                     f"{gib(r.peak_bytes)} {r.seconds:6.1f}  {','.join(r.sync_points)}")
    return lines
