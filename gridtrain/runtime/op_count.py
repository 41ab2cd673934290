"""The operators a step runs, counted: a stand-in for its kernel launches on a GPU.

A step's kernel launches cost time on a GPU (a few microseconds each, whatever the
tensor's size) that a CPU run does not show, and the usual way to pay too many is a
Python loop over parameters (a norm, a scale, a cast per tensor) where one multi-tensor
(``_foreach_*``) operator would do. :class:`OpCounter` is a dispatch mode that counts
the aten operators run while it is on, so that the count of one step can be held against
a plain PyTorch loop's on the same model (tests/test_launch_counts.py).

What is counted: every operator that reaches the dispatcher below autograd, which is
where a device kernel would be launched, including the backward's (autograd's engine
carries the mode into backward) and the collectives (``c10d`` operators: one NCCL kernel
each). What is not, because it launches nothing on any device: operators that only make
a view or read metadata (``view``, ``transpose``, ``as_strided``, ``detach``, ``split``'s
pieces, sizes and strides), allocations (``empty``: the caching allocator hands out
memory without a kernel; ``zeros`` is counted, its fill is one), dtype arithmetic
(``promote_types``), profiler markers and waits on a collective's result (a stream wait,
not a kernel). A ``_foreach_*`` operator counts as one, as a fused kernel counts as one;
on a GPU a ``_foreach`` call over many tensors may launch a few kernels (one per chunk
of tensors), which is still a few, not one per tensor.

Operators on a tensor subclass (DTensor: FSDP2's parameters) are declined, so that the
subclass runs them as operators on its local tensors, which the mode then counts: the
kernels that actually run, whatever wraps them.

Each count is kept per operator name and per category (:func:`category`): GEMMs,
multi-tensor and fused operators, norms, copies and casts, collectives, and the rest, so
that a comparison can say where a difference lies (:func:`excess`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# not views by their schema, but launch nothing: metadata, or a tensor handed back as it is
_NOTHING_RUNS = {"detach", "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
                 "is_same_size", "is_nonzero", "record_stream", "set_", "_has_compatible_shallow_copy_type",
                 "resize_", "promote_types", "result_type", "can_cast", "_record_function_enter_new",
                 "_record_function_exit", "_record_function_enter", "empty", "empty_like", "empty_strided",
                 "new_empty", "new_empty_strided", "_wrap_tensor_autograd", "wait_tensor"}
_READS = {"_local_scalar_dense", "item"}  # device to host: counted apart (see OpCounter)
_COPIES = {"copy_", "_to_copy", "clone", "contiguous", "to", "cat", "stack", "_foreach_copy_", "index_copy",
           "index_copy_", "_unsafe_view_copy"}
_NORMS = {"linalg_vector_norm", "norm", "_foreach_norm", "frobenius_norm"}
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm", "linear"}


def _name(func) -> str:
    """``aten.add_.Tensor`` -> ``add_``."""
    return func._schema.name.split("::")[-1]


def category(name: str, namespace: str = "aten") -> str:
    """Which kind of launch an operator is: ``gemm``, ``norm``, ``foreach`` (multi-tensor
    and fused optimizer operators: one call over many tensors), ``copy`` (copies, casts,
    concatenations), ``comm`` (collectives) or ``other``."""
    if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
        return "comm"
    if name in _GEMMS:
        return "gemm"
    if name in _NORMS:
        return "norm"
    if name.startswith("_foreach_") or name.startswith("_fused_"):
        return "foreach"
    if name in _COPIES:
        return "copy"
    return "other"


def launches(func) -> bool:
    """Whether running ``func`` would launch something on a device (not a view, not
    metadata)."""
    if getattr(func, "is_view", False):
        return False
    return _name(func) not in _NOTHING_RUNS


class OpCounter(TorchDispatchMode):
    """Counts the operators run while on (module docstring): :attr:`ops` per operator
    name, :attr:`categories` per :func:`category`, :attr:`phases` per phase of the step
    that the caller marks (:meth:`phase`; unmarked: ``""``), :attr:`total` all of them.
    Device-to-host reads (``.item()``, ``.tolist()``) are counted apart, in :attr:`reads`:
    on a CPU run every tensor is on the host, so whether a read would be a transfer and a
    synchronisation on a GPU depends on where the tensor would live there (AdamW's step
    counts stay on the host, the loss does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.categories: Counter[str] = Counter()
        self.phases: Counter[str] = Counter()
        self.reads = 0
        self._phase = ""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside under ``name`` in :attr:`phases` (the outer phase again after)."""
        outer, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = outer

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def reset(self) -> None:
        self.ops.clear()
        self.categories.clear()
        self.phases.clear()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            return NotImplemented  # a subclass: it runs its operators on plain tensors, counted then
        name = _name(func)
        if name in _READS:
            self.reads += 1
        elif launches(func):
            self.ops[name] += 1
            self.categories[category(name, func.namespace)] += 1
            self.phases[self._phase] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> str:
        """``N operators (gemm a, norm b, ...; phase c, ...), R reads``."""
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.categories.items()))
        phases = ", ".join(f"{k} {v}" for k, v in sorted(self.phases.items()) if k)
        return f"{self.total} operators ({kinds}{'; ' + phases if phases else ''}), {self.reads} reads"


def excess(mine: OpCounter, peer: OpCounter, top: int = 12) -> str:
    """The operators ``mine`` runs more often than ``peer``, largest excess first (what a
    failed comparison should print)."""
    more = sorted(((n - peer.ops.get(op, 0), op) for op, n in mine.ops.items() if n > peer.ops.get(op, 0)),
                  reverse=True)
    return ", ".join(f"{op} +{d}" for d, op in more[:top]) or "none"
