"""The saved-activation meter: how many bytes autograd keeps for backward, where, and
where they live.

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

It sits in ``runtime`` because the layers it measures use it: the decoder names its
layers (:func:`layer_scope`) and recomputation keeps its regions' inputs through it
(:func:`save`/:func:`load`); the run report and the dry run install it. What the bytes
should be is the memory model's (``gridtrain.memory``), which the measurements are
checked against.
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
        """A meter that ignores ``model``'s parameters and buffers (saved by reference).
        Empty ones are not excluded: ZeRO-3's sharded parameters are empty tensors,
        replaced when gathered, and an activation allocated later may get the storage
        identity one of them had."""
        tensors = list(model.parameters()) + list(model.buffers())
        return cls(excluded={_storage_key(t) for t in tensors if _storage_bytes(t) > 0})

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
