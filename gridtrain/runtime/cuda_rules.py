"""What a CUDA step must obey that a CPU run cannot show, checked on fake tensors.

On the CPU every copy is synchronous, every tensor is where the kernel runs and a
constant made on the host costs nothing. On a GPU:

* a ``non_blocking`` copy to the host returns before its data has landed: reading it on
  the host before a synchronisation (an event's or the stream's ``synchronize``, or
  ``torch.cuda.synchronize``) reads whatever the buffer held before -- silently (a copy
  of it back to the device is a stream's read, ordered by stream waits, not the host's);
* a host tensor copied to the device without ``non_blocking`` (``torch.tensor([...],
  device="cuda")``, ``t.cuda()`` of pageable memory) blocks the host until the device has
  drained its queue: a hidden synchronisation per call;
* a tensor made on the host (``torch.zeros(n)`` without the device) and then mixed with
  device tensors is a device mismatch that only fails there.

:class:`CudaRules` is a dispatch mode that sees every operation of a step on fake CUDA
tensors (the dry run's, gridtrain/dryrun.py) and records each breach of these rules with
its call site: a tensor of one or more dimensions made on the host from nothing (a
factory without ``pin_memory``), a blocking host-to-device copy of more than a scalar,
and any operation that reads the destination of a ``non_blocking`` device-to-host copy
before a synchronisation that covers it. Zero-dimensional host tensors are Python numbers
that CUDA kernels take as arguments, not transfers. Pinned host buffers made for a copy
(offloaded activations, the offloaded optimizer) are what they should be.

:func:`fake_cuda_runtime` stands in for the CUDA runtime where there is no GPU (a
cluster's login node, CI): events, streams and synchronisation become host objects that
tell :class:`CudaRules` which copies they cover, since their real versions need a driver.
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_NOT_READS = (_aten.detach.default, _aten.alias.default, _aten.record_stream.default)


class CudaRuleError(RuntimeError):
    """A step broke a rule that only a GPU would enforce (each breach with its call site)."""


@dataclass
class Breach:
    """One breach of a CUDA rule: which, the operation, where."""

    rule: str  # "host-tensor", "blocking-copy", "unwaited-copy"
    op: str
    site: str

    def __str__(self) -> str:
        what = {"host-tensor": "made a tensor on the host inside the step",
                "blocking-copy": "copied a host tensor to the device without non_blocking (a hidden sync)",
                "unwaited-copy": "read a non_blocking device-to-host copy before waiting for it"}[self.rule]
        return f"{self.site}: {self.op} {what}"


@dataclass
class _Copies:
    """``non_blocking`` device-to-host copies in flight, by destination storage, with the
    order they were issued in (a synchronisation covers the copies issued before it)."""

    pending: dict[int, int] = field(default_factory=dict)
    order: Iterator[int] = field(default_factory=itertools.count)

    def issued(self, t: torch.Tensor) -> None:
        self.pending[t.untyped_storage()._cdata] = next(self.order)

    def mark(self) -> int:
        """A point in the issue order (an event's record)."""
        return next(self.order)

    def covered(self, upto: int | None = None) -> None:
        """Every copy issued before ``upto`` (all: None) has landed."""
        self.pending = {k: n for k, n in self.pending.items() if upto is not None and n > upto}


_active: list["CudaRules"] = []  # the modes that the fake runtime's synchronisations inform


class CudaRules(TorchDispatchMode):
    """Record breaches of the CUDA rules (module docstring) by the operations of a block
    on fake tensors of device type ``device`` ("cuda")."""

    def __init__(self, device: str = "cuda"):
        super().__init__()
        self.device = device
        self.breaches: list[Breach] = []
        self.copies = _Copies()

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def _breach(self, rule: str, op: str) -> None:
        self.breaches.append(Breach(rule, op, call_site()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = list(tensors((args, kwargs)))
        if self.copies.pending and func not in _NOT_READS and not func.is_view and not self._to_device(func, args,
                                                                                                        kwargs):
            if any(t.untyped_storage()._cdata in self.copies.pending for t in inputs if t.device.type == "cpu"):
                self._breach("unwaited-copy", str(func.name()))
        out = func(*args, **kwargs)
        if func is _aten._to_copy.default:
            self._check_copy(str(func.name()), args[0], torch.device(kwargs.get("device") or args[0].device),
                             kwargs.get("non_blocking", False), out)
        elif func is _aten.copy_.default:
            self._check_copy(str(func.name()), args[1], args[0].device, bool(args[2]) if len(args) > 2 else
                             kwargs.get("non_blocking", False), out)
        if not inputs and not kwargs.get("pin_memory"):
            if any(t.device.type == "cpu" and t.dim() > 0 for t in tensors(out)):
                self._breach("host-tensor", str(func.name()))
        return out

    def _to_device(self, func, args, kwargs) -> bool:
        """A copy to the device: it reads its source on a stream, ordered after the copy
        that filled it by the stream's own waits (offloaded activations wait on an event
        of their copy stream), not on the host."""
        if func is _aten._to_copy.default:
            return torch.device(kwargs.get("device") or args[0].device).type == self.device
        return func is _aten.copy_.default and args[0].device.type == self.device

    def _check_copy(self, op: str, src: torch.Tensor, device: torch.device, non_blocking: bool,
                    out: torch.Tensor) -> None:
        """A copy from ``src`` to ``device`` (giving ``out``): a blocking one from the host
        to the device is a breach; a non-blocking one to the host is in flight."""
        to_device, from_device = torch.device(device).type == self.device, src.device.type == self.device
        if to_device and src.device.type == "cpu" and src.dim() > 0 and not non_blocking:
            self._breach("blocking-copy", op)
        if from_device and torch.device(device).type == "cpu" and non_blocking:
            self.copies.issued(out)


class KernelShapeError(CudaRuleError):
    """An operation's shapes break its CUDA kernel's rules (torch's meta function says which)."""


# kernels whose CUDA rules differ from the CPU's: dimensions of _scaled_mm multiples of 16,
# _grouped_mm's strides multiples of 16 bytes and its dtype
_CUDA_SHAPED = tuple(getattr(_aten, name).default for name in ("_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")
                     if hasattr(_aten, name))


class CudaKernelShapes(TorchDispatchMode):
    """Hold a step on fake CPU tensors to CUDA's kernel rules: each operation of
    :data:`_CUDA_SHAPED` is also run on fake CUDA tensors of the same shapes, strides and
    dtypes, where torch's meta function for CUDA checks them (a CPU kernel takes shapes the
    CUDA one refuses). Used where the step cannot run on fake CUDA itself (no GPU, or a CPU
    build of torch, where fake CUDA tensors can be made but not sliced)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (fp32 rows go to a CPU grouped GEMM that CUDA would not be given: the CPU's choice)
        if func in _CUDA_SHAPED and not (func is _CUDA_SHAPED[1] and args[0].dtype != torch.bfloat16):
            def on_cuda(x):
                if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")
                if isinstance(x, (list, tuple)):
                    return type(x)(on_cuda(y) for y in x)
                return x

            try:
                func(*on_cuda(list(args)), **{k: on_cuda(v) for k, v in kwargs.items()})
            except RuntimeError as e:
                raise KernelShapeError(f"{call_site()}: {func.name()} on CUDA refuses these shapes "
                                       f"{[tuple(t.shape) for t in tensors(args)]}: {e}") from None
        return func(*args, **kwargs)


def call_site(frames=None, skip: tuple[str, ...] = ()) -> str:
    """The innermost frame outside torch, this module and the files in ``skip`` (of
    ``frames``, default: the current stack): who issued the operation."""
    torch_dir = str(Path(torch.__file__).parent)
    for frame in reversed(frames if frames is not None else traceback.extract_stack()):
        if not frame.filename.startswith(torch_dir) and frame.filename not in (__file__, *skip) \
                and "contextlib" not in frame.filename and frame.name != "__torch_dispatch__":
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "unknown"


def tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from tensors(x)


# ---- a CUDA runtime without a GPU ----------------------------------------------------------

def _covered(upto: int | None = None) -> None:
    for rules in _active:
        rules.copies.covered(upto)


class FakeEvent:
    """``torch.cuda.Event`` on the host: recording marks the copies issued so far;
    synchronising covers them."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.marks: list[tuple["CudaRules", int]] = []

    def record(self, stream=None) -> None:
        self.marks = [(rules, rules.copies.mark()) for rules in _active]

    def synchronize(self) -> None:
        for rules, upto in self.marks:
            rules.copies.covered(upto)

    def wait(self, stream=None) -> None:  # a stream waits: the host does not
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return 0.0


class FakeStream:
    """``torch.cuda.Stream`` on the host."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = device

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _covered()

    def query(self) -> bool:
        return True


PLANNED_CAPABILITY = (9, 0)  # without a GPU, the dry run plans for a Hopper-class one


@contextlib.contextmanager
def fake_cuda_runtime() -> Iterator[None]:
    """Inside: ``torch.cuda``'s events, streams and synchronisation are host stand-ins
    (:class:`FakeEvent`, :class:`FakeStream`) that need no driver; without a GPU the
    device's capability is :data:`PLANNED_CAPABILITY` (torch's own collectives ask it)."""
    default = FakeStream()
    replaced = {"Event": FakeEvent, "Stream": FakeStream, "current_stream": lambda device=None: default,
                "default_stream": lambda device=None: default, "stream": lambda s: contextlib.nullcontext(),
                "synchronize": lambda device=None: _covered()}
    if not torch.cuda.is_available():
        replaced["get_device_capability"] = lambda device=None: PLANNED_CAPABILITY
    saved = {name: getattr(torch.cuda, name) for name in replaced}
    for name, value in replaced.items():
        setattr(torch.cuda, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
