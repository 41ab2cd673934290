"""Split backward for zero-bubble schedules: input gradients now, weight gradients later.

A linear layer's backward has two independent products: ``grad_input = grad_out @ W``
(needed at once by the previous layer, and by the previous pipeline stage) and
``grad_W = grad_out^T @ input`` (needed only by the optimizer). ZB-H1 runs the first in
its B action and defers the second to a W action that fills pipeline bubbles.

While a :class:`WeightGradStore` is *deferring*, every linear layer built on
:func:`linear` computes its input gradient and queues a closure for its weight gradient
under the current micro-batch key; ``flush(key)`` runs them later. Parameters that are
not linear weights (LayerNorm, biases, embeddings) get their gradients in B as usual:
they are cheap. Gradients are identical to a plain backward.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F


class WeightGradStore:
    def __init__(self) -> None:
        self.key: Hashable | None = None  # deferring while set
        self.pending: dict[Hashable, list[Callable[[], None]]] = defaultdict(list)

    @contextlib.contextmanager
    def defer(self, key: Hashable):
        """Within this block, linear weight gradients are queued under ``key``."""
        self.key = key
        try:
            yield
        finally:
            self.key = None

    def add(self, fn: Callable[[], None]) -> None:
        self.pending[self.key].append(fn)

    @torch.no_grad()
    def flush(self, key: Hashable) -> None:
        for fn in self.pending.pop(key, []):
            fn()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add a deferred weight gradient, and tell the gradient reducer, as autograd's own
    post-accumulate hooks would; or hand it to the reducer at once where it takes
    gradients itself (``grad_sink``: ZeRO-2/3, whose parameters may be freed by then)."""
    _tell_deferred(param, -1)
    sink = getattr(param, "grad_sink", None)
    if sink is not None:
        sink(param, grad)
        return
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
    hook = getattr(param, "grad_ready_hook", None)
    if hook is not None:
        hook(param)


def weight_grad_of(weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor,
                   store: WeightGradStore | None, product: Callable[[], torch.Tensor] | None = None
                   ) -> torch.Tensor | None:
    """The weight gradient ``grad_out^T x`` (or ``product()``, the same product computed
    otherwise: float8), returned for autograd to accumulate; or, while ``store`` is
    deferring (ZB's B), queued for W, which accumulates it itself (returns None then)."""
    def weight_grad() -> torch.Tensor:
        if product is not None:
            return product().to(weight.dtype)
        g = grad_out.reshape(-1, grad_out.shape[-1]).transpose(0, 1) @ x.reshape(-1, x.shape[-1]).to(grad_out.dtype)
        return g.to(weight.dtype)

    if store is None or store.key is None:
        return weight_grad()
    _tell_deferred(weight, 1)
    store.add(lambda: _accumulate(weight, weight_grad()))
    return None


def _tell_deferred(param: torch.Tensor, change: int) -> None:
    """Tell whoever asked (``grad_deferred_hook``: ZeRO-3, which frees a block after its B
    although its weights' gradients come in W) that a gradient of ``param`` was deferred
    (+1) or has come (-1)."""
    hook = getattr(param, "grad_deferred_hook", None)
    if hook is not None:
        hook(param, change)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x)
        # The parameter itself, not a saved copy: its .grad is set later, and a tensor
        # unpacked through saved-tensor hooks need not be the parameter object.
        ctx.weight, ctx.store = weight, store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        return grad_out @ weight.to(grad_out.dtype), weight_grad_of(weight, grad_out, x, ctx.store), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           store: WeightGradStore | None) -> torch.Tensor:
    """``F.linear``, with a weight gradient that ``store`` may defer. The same operations
    whether or not autograd records, so a recomputed region rebuilds the exact values."""
    if store is None:
        return F.linear(x, weight, bias)
    y = outside_compiled_graphs(_DeferrableLinear.apply, x, weight, store)
    return y if bias is None else y + bias


def _call(apply: Callable, *args):
    return apply(*args)


# ``_call`` behind ``torch._dynamo.disable`` once :func:`keep_out_of_compiled_graphs` ran.
# Not at import: importing torch._dynamo costs about 2 s of CPU, in every worker process.
_eager_call: Callable = _call


def keep_out_of_compiled_graphs() -> None:
    """Make :func:`outside_compiled_graphs` a graph break for ``torch.compile``; call it
    before compiling anything that holds deferrable linears (``compile_blocks`` does)."""
    global _eager_call
    import torch._dynamo

    if _eager_call is _call:
        _eager_call = torch._dynamo.disable(_call)


def outside_compiled_graphs(apply: Callable, *args):
    """``apply(*args)``, always eager, also inside a compiled block (``--compile``): an
    autograd function whose backward may defer must decide when that backward runs
    (``store.key``); traced into a compiled graph, the decision would be fixed once, at
    tracing time. Only after :func:`keep_out_of_compiled_graphs`: ``torch.compile`` of a
    model with deferrable linears that did not call it (``compile_blocks`` does) would
    trace the decision into its graph."""
    return _eager_call(apply, *args)
