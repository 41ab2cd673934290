"""Activation memory: how many bytes autograd keeps for backward, where, and where they live.

Everything an operation saves for its backward passes through ``saved_tensors_hooks``;
:class:`SavedActivations` installs one pair of hooks that does two things:

* **counting** (:class:`ActivationMeter`): each saved tensor is charged, once per storage
  (``q`` and ``k`` viewing one QKV buffer cost one buffer), to the layer that is running
  (:func:`layer_scope`), and the bytes still referenced by some autograd graph are
  tracked as they are released, so a stage's peak shows how many micro-batches a schedule
  keeps alive. Parameters and buffers are not activations and are not charged;
* **offloading** (``offload=True``): on a GPU each saved tensor is copied to pinned host
  memory at once and back when backward needs it, trading PCIe traffic for device memory
  (the other sublinear-memory technique besides recomputation). The copy to the host runs
  on a side stream of its own (one per device), after the compute stream's work that
  produced the tensor, so forward goes on while it travels; the device memory is handed
  back to the allocator only once the copy has read it (``record_stream``), and the copy
  back waits for it (an event). The copy back is issued when backward asks for the
  tensor, on the compute stream: there is no prefetch yet. On a CPU the tensors are
  already in host memory, so there is nothing to move.

:func:`korthikanti_bytes` is the formula of Korthikanti et al. (2022) for the bytes a
transformer layer saves, adapted to this implementation (see docs/memory.md), so the
measured numbers can be checked against it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

_scope: list[str] = ["other"]  # the layer being run: who is charged for what is saved
_phase: list[str] = ["forward"]  # "forward", or "recompute" inside a recomputed region
_active: list["SavedActivations"] = []  # the installed hooks, innermost last


@contextlib.contextmanager
def layer_scope(name: str, phase: str | None = None) -> Iterator[None]:
    """Charge tensors saved inside this block to layer ``name`` (and ``phase``)."""
    _scope.append(name)
    _phase.append(phase or _phase[-1])
    try:
        yield
    finally:
        _scope.pop()
        _phase.pop()


def current_scope() -> str:
    return _scope[-1]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    """The storage's identity (its StorageImpl), which fake tensors (the dry run) have
    too; their data pointers are meaningless."""
    return (t.device.type, t.untyped_storage()._cdata)


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class ActivationMeter:
    """Bytes saved for backward: per layer and phase (new storages only), and the live
    total of storages that some graph still holds, with its peak."""

    excluded: set[tuple[str, int]] = field(default_factory=set)
    saved: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    live: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # key -> [bytes, refs]
    live_bytes: int = 0
    peak_bytes: int = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "ActivationMeter":
        """A meter that ignores ``model``'s parameters and buffers (saved by reference)."""
        tensors = list(model.parameters()) + list(model.buffers())
        return cls(excluded={_storage_key(t) for t in tensors})

    def acquire(self, t: torch.Tensor) -> tuple[str, int] | None:
        """A graph now references ``t``; returns the key to release, None if not counted."""
        if t.layout != torch.strided or t.device.type == "meta":
            return None
        key = _storage_key(t)
        if key in self.excluded:
            return None
        entry = self.live.get(key)
        if entry is None:
            nbytes = _storage_bytes(t)
            self.live[key] = [nbytes, 1]
            self.saved[(current_scope(), _phase[-1])] += nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[1] += 1
        return key

    def release(self, key: tuple[str, int]) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self.live[key]

    def by_layer(self, phase: str = "forward") -> dict[str, int]:
        return {layer: n for (layer, p), n in self.saved.items() if p == phase}


class _Saved:
    """What autograd holds instead of a saved tensor while the hooks are installed; its
    release (the graph dropping it) is what the meter sees as the memory being freed."""

    __slots__ = ("tensor", "device", "meter", "key", "copied")

    def __init__(self, tensor: torch.Tensor, device: torch.device | None, meter: ActivationMeter | None,
                 key: tuple[str, int] | None, copied: "torch.cuda.Event | None" = None):
        self.tensor, self.device, self.meter, self.key = tensor, device, meter, key
        self.copied = copied  # offloaded: completes when the copy to the host has

    def get(self) -> torch.Tensor:
        if self.device is None:
            return self.tensor
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
        return self.tensor.to(self.device, non_blocking=True)

    def __del__(self) -> None:
        # getattr: a compiled block's tracing may make one without running __init__
        meter, key = getattr(self, "meter", None), getattr(self, "key", None)
        if meter is not None and key is not None:
            meter.release(key)


class SavedActivations:
    """The saved-tensor hooks of a training step: count with ``meter``, and ``offload``.

    Use as a context manager around forward *and* backward (recomputation saves tensors
    during backward). :func:`save`/:func:`load` route tensors that gridtrain keeps by
    hand (a recomputed region's inputs) through the same accounting.
    """

    def __init__(self, meter: ActivationMeter, offload: bool = False):
        self.meter, self.offload = meter, offload
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> _Saved:
        key = self.meter.acquire(t)
        if self.offload and key is not None and t.device.type == "cuda":
            return _offload(t, self.meter, key)
        return _Saved(t, None, self.meter, key)

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.get()

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.pop()
        self._hooks.__exit__(*exc)


_copy_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def _offload(t: torch.Tensor, meter: ActivationMeter, key: tuple[str, int]) -> _Saved:
    """Copy ``t`` to pinned host memory on the device's side stream (module docstring)."""
    stream = _copy_streams.get(t.device)
    if stream is None:
        stream = _copy_streams[t.device] = torch.cuda.Stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t has been computed
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
        copied = stream.record_event()
    t.record_stream(stream)  # the allocator may reuse t's memory once the copy has read it
    return _Saved(host, t.device, meter, key, copied)


def save(t: torch.Tensor) -> torch.Tensor | _Saved:
    """Keep ``t`` for backward by hand, counted and offloaded like autograd's saves."""
    return _active[-1].pack(t) if _active else t


def load(saved: torch.Tensor | _Saved) -> torch.Tensor:
    return saved.get() if isinstance(saved, _Saved) else saved


def saved_activations(meter: ActivationMeter | None, offload: bool = False):
    """The hooks for one step; none at all (no cost) when there is nothing to count."""
    return contextlib.nullcontext() if meter is None else SavedActivations(meter, offload)


# ---- the formula ------------------------------------------------------------------------------

def dropout_mask_bytes(device: torch.device, element_bytes: int) -> int:
    """Bytes per element of the mask dropout saves: CUDA's fused kernel keeps a bool mask;
    on CPU torch multiplies by a scaled mask of the activation's own dtype and keeps that."""
    return 1 if torch.device(device).type == "cuda" else element_bytes


def korthikanti_bytes(*, seq: int, batch: int, hidden: int, heads: int, ffn: int, tp: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none", element_bytes: int = 2,
                      mask_bytes: int = 1, dropout: bool = True, arch: str = "gpt2",
                      kv_hidden: int | None = None, attention: str = "math") -> float:
    """Activation bytes one transformer layer saves for backward, per micro-batch.

    Korthikanti et al. count, in 16-bit with 1-byte dropout masks and ffn = 4h,
    ``sbh (34 + 5as/h)``, with TP ``sbh (10 + 24/t + 5as/(ht))``. Term by term, for
    element size e and mask size m:

    * the two norms' inputs 2e, the inputs of QKV and of the first MLP linear(s) 2e, and
      the residual dropout masks 2m: replicated over TP, split by sequence parallelism (a
      column-parallel layer keeps its input shard and all-gathers it again in backward);
    * Q, K, V 3e and the output projection's input e, split over TP. Llama's keys and
      values are its kv heads repeated for their query heads inside the attention core,
      so they cost as much as GPT-2's; with selective recomputation the core's inputs
      are kept instead: the un-repeated keys and values, 2e ``kv_hidden`` (this rank's
      kv heads times head size, whole kv heads per rank);
    * the MLP, split over TP: GPT-2 keeps GELU's input and output, 2e * ffn/h; Llama's
      SwiGLU keeps gate's output (silu's input), silu's output, up's output and their
      product (down's input), 4e * ffn/h;
    * attention scores: softmax output e, and with dropout its mask m and its output e,
      per (head, query, key): ``a s^2 b / t`` of them.

    That is the op-by-op core (``attention="math"``). Torch's fused kernel (``sdpa``)
    keeps no scores: it saves its inputs (the un-repeated keys and values: it reads
    shared kv heads in place), its output (a tensor of its own: the projection keeps
    the copy that joins the heads) and one fp32 log-sum-exp per (head, query); dropout
    is drawn again from the RNG state in backward. That assumes torch runs a fused
    kernel (flash or memory-efficient) for the shapes at hand.

    ``selective`` drops the attention-score terms (they are recomputed); ``full`` keeps
    only the layer input, ``e sbh`` (``/ t`` under sequence parallelism). The norms'
    per-token statistics (one or two numbers a token) are left out.
    """
    tokens = seq * batch
    if recompute == "full":
        return tokens * hidden * element_bytes / (tp if sequence_parallel else 1)
    t = _terms(seq=seq, hidden=hidden, heads=heads, ffn=ffn, tp=tp, sequence_parallel=sequence_parallel,
               element_bytes=element_bytes, mask_bytes=mask_bytes, dropout=dropout, arch=arch, kv_hidden=kv_hidden,
               attention=attention)
    if recompute == "selective":
        return tokens * (t["before_core"] + t["core_inputs"] + t["after_core"])
    return tokens * (t["before_core"] + t["q_k_v"] + t["scores"] + t["after_core"])


def rebuilt_core_bytes(**shape) -> float:
    """Under selective recomputation, how far one layer's rebuilt attention core (held
    while its backward runs) lifts the bytes held above what the layer keeps: the core
    saves its scores terms again (and, for Llama, its repeated keys and values), while
    backward has already released everything the layer saved after its core (the
    projection's input, the second norm, the MLP, the dropout masks). Zero when the
    release is larger; per micro-batch, for the last block of a chunk (the worst)."""
    t = _terms(**{k: v for k, v in shape.items() if k not in ("batch", "recompute")})
    return shape["seq"] * shape["batch"] * max(0.0, t["scores"] + t["repeated_kv"] - t["after_core"])


def _terms(*, seq: int, hidden: int, heads: int, ffn: int, tp: int, sequence_parallel: bool,
           element_bytes: int, mask_bytes: int, dropout: bool, arch: str = "gpt2",
           kv_hidden: int | None = None, attention: str = "math") -> dict[str, float]:
    """Bytes per token of each part of a layer (see korthikanti_bytes)."""
    e, m, d = element_bytes, mask_bytes, int(dropout)
    sp = tp if sequence_parallel else 1
    llama = arch == "llama"
    fused = attention != "math"
    repeated = llama and kv_hidden is not None and kv_hidden < hidden / tp and not fused  # shared kv heads
    core_inputs = e * hidden / tp + 2 * e * (kv_hidden if llama else hidden / tp)
    return {
        "before_core": 2 * e * hidden / sp,  # first norm's input, q/k/v's input
        # the core's q, k, v (op by op, Llama's k and v repeated per query head); fused, its
        # inputs as they are and its own output
        "q_k_v": core_inputs + e * hidden / tp if fused else 3 * e * hidden / tp,
        "core_inputs": core_inputs,  # kept by selective
        "scores": heads / tp * 4 if fused else heads * seq / tp * (e + d * (e + m)),  # fused: fp32 log-sum-exp
        "repeated_kv": 2 * e * hidden / tp if repeated else 0.0,
        "after_core": e * hidden / tp + hidden * (2 * e + 2 * m * d) / sp + (4 if llama else 2) * e * ffn / tp,
    }


def layer_shape(m, *, batch: int, tp: int, sequence_parallel: bool, element_bytes: int,
                mask_bytes: int) -> dict:
    """The keyword arguments of :func:`korthikanti_bytes` for model config ``m``
    (config.ModelConfig) at micro-batch ``batch`` on ``tp`` ranks."""
    kv_per_rank = max(m.kv_heads // tp, 1)  # whole kv heads per rank: replicated when tp exceeds them
    return dict(seq=m.seq_len, batch=batch, hidden=m.d_model, heads=m.n_head, ffn=m.ffn_size, tp=tp,
                sequence_parallel=sequence_parallel, element_bytes=element_bytes, mask_bytes=mask_bytes,
                dropout=m.dropout > 0, arch=m.arch, kv_hidden=kv_per_rank * m.head_dim, attention=m.attention)


# ---- what a stage reports -----------------------------------------------------------------------

@dataclass
class StageMemory:
    """One stage's measured activation memory over a step (picklable, gathered to print)."""

    stage: int
    micro_batches: int
    kept: dict[str, int]  # layer -> bytes saved at forward, summed over the step's micro-batches
    recomputed: dict[str, int]  # layer -> bytes saved while recomputing, summed likewise
    peak_bytes: int  # most bytes held for backward at once during the step
    expected: dict[str, float] = field(default_factory=dict)  # layer -> formula, per micro-batch
    device_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated over the step

    def per_micro_batch(self, layer: str) -> float:
        return self.kept.get(layer, 0) / max(1, self.micro_batches)


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def summary_line(stages: list[StageMemory]) -> str:
    """One line for the run summary: each stage's peak and per-micro-batch bytes."""
    parts = []
    for s in stages:
        device = f", device peak {_mb(s.device_peak_bytes)}" if s.device_peak_bytes is not None else ""
        parts.append(f"stage {s.stage} peak {_mb(s.peak_bytes)} "
                     f"({_mb(sum(s.kept.values()) / max(1, s.micro_batches))} per micro-batch{device})")
    return "activations saved for backward (step 1): " + "; ".join(parts)


def report_lines(stages: list[StageMemory], note: str) -> list[str]:
    """The --memory-report table: per stage and layer, bytes kept per micro-batch, bytes
    saved while recomputing (transient), and the formula where one applies."""
    lines = [f"memory report (step 1; {note})",
             f"  {'stage':>5} {'layer':<12} {'kept/micro-batch':>17} {'recompute':>12} {'formula':>12} {'ratio':>6}"]
    for s in stages:
        for layer in sorted(set(s.kept) | set(s.recomputed), key=_layer_order):
            kept = s.per_micro_batch(layer)
            redo = s.recomputed.get(layer, 0) / max(1, s.micro_batches)
            expected = s.expected.get(layer)
            formula = f"{_mb(expected):>12}" if expected is not None else f"{'-':>12}"
            ratio = f"{kept / expected:6.3f}" if expected else f"{'-':>6}"
            lines.append(f"  {s.stage:>5} {layer:<12} {_mb(kept):>17} {_mb(redo):>12} {formula} {ratio}")
        lines.append(f"  {s.stage:>5} {'peak':<12} {_mb(s.peak_bytes):>17}")
    return lines


def _layer_order(name: str) -> tuple[int, int]:
    if name.startswith("blocks."):
        return (1, int(name.split(".")[1]))
    return ({"embedding": 0, "head": 2}.get(name, 3), 0)


def expected_by_layer(runs: list[tuple[tuple[int, ...], bool]], mode: str, micro_batches: int,
                      keep_last: bool, **shape) -> dict[str, float]:
    """The formula's bytes per micro-batch for each block of a stage, given which runs of
    blocks are recomputed regions (charged to their first block) and whether the last
    micro-batch keeps everything."""
    plain = korthikanti_bytes(recompute="none", **shape)
    kept_mode = "selective" if mode == "selective" else "none"
    out: dict[str, float] = {}
    for ids, recomputed in runs:
        for n, i in enumerate(ids):
            value = (korthikanti_bytes(recompute="full", **shape) if n == 0 else 0.0) if recomputed \
                else korthikanti_bytes(recompute=kept_mode, **shape)
            if keep_last and mode != "none":
                value = ((micro_batches - 1) * value + plain) / micro_batches
            out[f"blocks.{i}"] = value
    return out
