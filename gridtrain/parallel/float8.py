"""Float8 GEMMs for the blocks' linear layers, with the scales one process would compute.

``--fp8 tensorwise|rowwise`` runs the three GEMMs of every block linear (forward, input
gradient, weight gradient) on float8 operands with dynamic scales, the recipes of
torchao's float8 training (``torchao.float8``, an optional dependency: its casts, scale
rule and ``torch._scaled_mm`` call are used here):

* ``tensorwise``: one scale per tensor; inputs and weights in e4m3, output gradients in
  e5m2 (their range matters more than their precision); each operand is cast once and
  the cast serves both GEMMs that read it;
* ``rowwise``: a scale per row of each operand along the GEMM's reduction dimension,
  rounded down to a power of two, e4m3 throughout; each GEMM casts its own operands
  (a weight is scaled per output row for the forward, per input column for the input
  gradient).

**The scales are layout-independent.** A scale is ``max(e4m3 or e5m2) / amax``; the amax
of an operand that the layout splits is reduced (``MAX``) over the ranks that hold its
parts, so every layout quantises the same values with the same scale:

* a weight's scales are computed once per optimizer step (:func:`refresh_weight_scales`:
  after the step, and at start) from what the rank holds, reduced over the ZeRO-3 shard
  group (its flat pieces) and over tp where tp splits the reduced dimension (tensorwise:
  always; rowwise: a column-parallel weight's input-gradient scales, a row-parallel
  weight's forward scales);
* an activation or output gradient is reduced over cp (a micro-batch's tokens spread
  over the cp ranks; under sequence parallelism the linears see whole sequences: the
  column layer casts after its all-gather, the row layer's output gradient arrives
  gathered) and over tp where tp splits its features (a row layer's input, a column
  layer's output gradient). Rowwise scales along the features are per token, so only
  the tp reduction applies; the weight gradient's scales run along the tokens, so only
  the cp one does.

**Experts** see tokens that the layout gathers from several ranks' micro-batches (the
expert-parallel all-to-all), so no scale over an expert's tokens can be the one-process
one. Their rows and output gradients are therefore scaled per token under both recipes
(a token's scale depends only on itself), their weights per expert (tensorwise) or per
row (rowwise), and their weight gradient (a sum over the tokens) stays in bf16, as
torchao's ``rowwise_with_gw_hp`` recipe keeps it. Under expert tensor parallelism
(``--etp``) a token's row is split where the slice splits it (the down projection's
input, gate and up's output gradient): its amax is reduced over the etp group, as are
the slices' weight amaxes.

**Not float8**: the embedding, the head and the router (as torchao and Megatron leave
them), and a column layer whose weight slice several tp ranks hold (Llama key/value
heads when tp exceeds their count, MLA's latent projections): each of those ranks sees
only a partial sum of the output gradient, whose amax is not the one-process one.

On CPU the GEMMs are emulated: the float8 operands dequantised to fp32 and multiplied
there, exactly what the scaled GEMM computes up to its accumulation order (torch's CPU
``_scaled_mm`` is a reference kernel, hundreds of times slower). On CUDA they run as
``torch._scaled_mm`` (torchao's call; fast accumulation for the forward only, as its
recipes). Experts' grouped GEMMs are emulated on every device (docs/fp8.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gridtrain.parallel.comm import CommGroup, single

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
TORCHAO_HINT = "pip install gridtrain[fp8] (torchao>=0.18)"


def torchao_problem() -> str | None:
    """Why ``--fp8`` cannot run here (torchao missing or too old), or None."""
    try:
        _ao()
    except ImportError as e:
        return f"--fp8 needs torchao's float8 training, which does not import here ({e}); {TORCHAO_HINT}"
    return None


def capability_problem(recipe: str, capability: tuple[int, int], name: str = "this GPU") -> str | None:
    """Why ``recipe`` cannot run on a GPU of ``capability`` (torch._scaled_mm: float8
    GEMMs from 8.9, Ada; rowwise scales from 9.0, Hopper), or None."""
    need = (9, 0) if recipe == "rowwise" else (8, 9)
    if tuple(capability) >= need:
        return None
    fix = "use --fp8 tensorwise or drop --fp8" if recipe == "rowwise" and tuple(capability) >= (8, 9) else \
        "drop --fp8"
    return (f"--fp8 {recipe} needs float8 GEMMs{' with rowwise scales' if recipe == 'rowwise' else ''} (compute "
            f"capability {need[0]}.{need[1]} or newer), and {name} is {capability[0]}.{capability[1]}; {fix}")


def _ao():
    """torchao's pieces (imported on first use: torchao is optional)."""
    import logging

    global _AO
    if _AO is None:
        # quiet: torchao's CUDA-only extensions warn when they do not load, and torch's
        # pytree warns about an enum torchao registers
        quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            from torchao.float8.float8_ops import addmm_float8_unwrapped
            from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
        _AO = amax_to_scale, to_fp8_saturated, addmm_float8_unwrapped
    return _AO


_AO = None


@dataclass
class WeightScales:
    """One weight's scales for the step (:func:`refresh_weight_scales`): ``tensor`` (0-d,
    tensorwise) or ``rows`` ``[N, 1]`` (forward, per output row) and ``cols`` ``[1, K]``
    (input gradient, per input column), fp32."""

    tensor: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None


@dataclass
class ScaleLog:
    """The scales of the first micro-batch's casts, by (weight name or id, operand), for
    tests: that every layout computes the one-process scales. Recording stops after
    ``limit`` entries."""

    entries: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    limit: int = 256

    def add(self, key: str, operand: str, scale: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # a dict written inside a compiled graph breaks it
            return
        if len(self.entries) < self.limit and (key, operand) not in self.entries:
            self.entries[(key, operand)] = scale.detach().clone()  # on the device: no host read


@dataclass
class Float8:
    """The run's float8 recipe and the groups its scales are reduced over: ``tp`` (the
    tensor-parallel group) and ``tokens`` (the ranks over which one micro-batch's tokens
    are spread: cp). ``emulate``: dequantised fp32 GEMMs (CPU)."""

    recipe: str
    tp: CommGroup = field(default_factory=lambda: single("tp"))
    tokens: CommGroup = field(default_factory=lambda: single("cp"))
    emulate: bool = True
    log: ScaleLog | None = None

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown float8 recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def grad_dtype(self) -> torch.dtype:
        return E4M3 if self.rowwise else E5M2

    # ---- casts ------------------------------------------------------------------------------

    def scale(self, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        amax_to_scale, _, _ = _ao()
        return amax_to_scale(amax, dtype, round_scales_to_power_of_2=self.rowwise)

    def cast(self, t: torch.Tensor, dim: int | None, groups: tuple[CommGroup, ...], dtype: torch.dtype,
             note: tuple[torch.Tensor, str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``t`` in float8 with its dynamic scale: over the whole tensor (``dim`` None) or
        per row along ``dim`` (kept as a dimension of size 1), the amax reduced over
        ``groups``. Returns (float8 data, fp32 scale). ``note``: (weight, operand) for the
        scale log; nothing of the weight is read while compiling (a name or id read per
        layer would make dynamo compile each block again)."""
        amax = t.detach().abs().amax() if dim is None else t.detach().abs().amax(dim=dim, keepdim=True)
        amax = reduce_max(amax.float(), groups)
        s = self.scale(amax, dtype)
        if note is not None and self.log is not None and not torch.compiler.is_compiling():
            self.log.add(*_note(*note), s)
        return cast_with(t, s, dtype), s

    # ---- the three GEMMs of a linear layer ---------------------------------------------------------
    # ``kind``: "column" (the weight's output rows split over tp: the output gradient's
    # features are split) or "row" (its input columns split: the input's features are)

    def _groups(self, split: bool) -> tuple[CommGroup, ...]:
        return (self.tokens, self.tp) if split else (self.tokens,)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``x W^T`` in float8 (``x`` [..., K], ``W`` [N, K]); returns it (``x``'s dtype)
        and ``x``'s scale (the tensorwise weight gradient casts ``x`` again with it)."""
        x2 = x.reshape(-1, x.shape[-1])
        split = kind == "row" and self.tp.size > 1
        if self.rowwise:
            xq, xs = self.cast(x2, -1, (self.tp,) if split else (), E4M3, (weight, "input"))
        else:
            xq, xs = self.cast(x2, None, self._groups(split), E4M3, (weight, "input"))
        ws = weight_scales(weight, self)
        w_scale = ws.rows.t() if self.rowwise else ws.tensor
        y = self.mm(xq, xs, cast_with(weight, ws.rows if self.rowwise else ws.tensor, E4M3).t(), w_scale,
                    x.dtype, fast=True)
        return y.view(*x.shape[:-1], weight.shape[0]), xs

    def grad_input(self, grad_out: torch.Tensor, weight: torch.Tensor, kind: str
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``g W`` (``g`` [..., N]); returns it and, tensorwise, ``g``'s cast (the weight
        gradient reads the same one)."""
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        split = kind == "column" and self.tp.size > 1
        ws = weight_scales(weight, self)
        if self.rowwise:
            gq, gs = self.cast(g2, -1, (self.tp,) if split else (), E4M3, (weight, "grad_output"))
            out = self.mm(gq, gs, cast_with(weight, ws.cols, E4M3), ws.cols, grad_out.dtype)
            kept = None
        else:
            gq, gs = self.cast(g2, None, self._groups(split), E5M2, (weight, "grad_output"))
            out = self.mm(gq, gs, cast_with(weight, ws.tensor, E4M3), ws.tensor, grad_out.dtype)
            kept = (gq, gs)
        return out.view(*grad_out.shape[:-1], weight.shape[1]), kept

    def grad_weight(self, grad_out: torch.Tensor, x: torch.Tensor, x_scale: torch.Tensor,
                    kept: tuple[torch.Tensor, torch.Tensor] | None) -> Callable[[], torch.Tensor]:
        """``g^T x`` as a closure: the casts (and their collectives) happen now, the GEMM
        when called (a split backward defers it to W)."""
        g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        dtype = grad_out.dtype
        if self.rowwise:  # along the tokens: per output feature of g, per input feature of x
            gq, gs = self.cast(g2, 0, (self.tokens,), E4M3)
            xq, xs = self.cast(x2, 0, (self.tokens,), E4M3)
            return lambda: self.mm(gq.t(), gs.t(), xq, xs, dtype)
        gq, gs = kept
        xq = cast_with(x2, x_scale, E4M3)
        return lambda: self.mm(gq.t(), gs, xq, x_scale, dtype)

    # ---- the GEMM -------------------------------------------------------------------------------

    def mm(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
           out_dtype: torch.dtype, fast: bool = False) -> torch.Tensor:
        """``(a / a_scale) @ (b / b_scale)`` for float8 ``a`` [M, K], ``b`` [K, N]; scales
        0-d, or ``[M, 1]`` and ``[1, N]``. ``torch._scaled_mm`` takes only dimensions
        that are multiples of 16: others are padded with zeros (rows of ``a``, columns of
        ``b`` cut off the result; the reduction's padding adds nothing), as torchao pads."""
        if self.emulate:
            return torch.mm(a.float() / a_scale, b.float() / b_scale).to(out_dtype)
        _, _, addmm = _ao()
        if a_scale.dim() != b_scale.dim():  # one rowwise, one tensorwise: both rowwise
            a_scale = a_scale.reshape(1, 1).expand(a.shape[0], 1) if a_scale.dim() == 0 else a_scale
            b_scale = b_scale.reshape(1, 1).expand(1, b.shape[1]) if b_scale.dim() == 0 else b_scale
        (m, k), n = a.shape, b.shape[1]
        pm, pk, pn = (-m) % ALIGN, (-k) % ALIGN, (-n) % ALIGN
        if pm or pk:
            a = _padded(a, (0, pk, 0, pm))
            a_scale = _padded(a_scale, (0, 0, 0, pm), 1.0) if a_scale.dim() else a_scale
        if pk or pn:
            b = _padded(b, (0, pn, 0, pk))
            b_scale = _padded(b_scale, (0, pn), 1.0) if b_scale.dim() else b_scale
        a = a.contiguous()  # row-major a, column-major b: what torch._scaled_mm takes
        b = b.t().contiguous().t()
        out = addmm(a, a_scale.contiguous(), b, b_scale.contiguous(), out_dtype, use_fast_accum=fast)
        return out[:m, :n] if pm or pn else out


ALIGN = 16  # torch._scaled_mm: every dimension a multiple of 16


def _padded(t: torch.Tensor, pad: tuple[int, ...], value: float = 0.0) -> torch.Tensor:
    """``t`` padded at the ends (``torch.nn.functional.pad`` order); float8 has no
    arithmetic, so its bytes are padded (zero bytes are 0.0 in e4m3 and e5m2)."""
    if t.dtype in (E4M3, E5M2):
        return torch.nn.functional.pad(t.view(torch.uint8), pad).view(t.dtype)
    return torch.nn.functional.pad(t, pad, value=value)


def padding_note(model: torch.nn.Module, tokens: int) -> str | None:
    """What the run pads at every float8 GEMM (said once at start), or None: the tokens of
    a micro-batch as one rank's linears see them (the weight gradient's reduction) and the
    float8 weights' local dimensions that are not multiples of 16."""
    odd = [f"{tokens} tokens a micro-batch"] if tokens % ALIGN else []
    for name, p in model.named_parameters():
        shape = tuple(getattr(p, "whole_shape", p.shape))
        if kind_of(p) is not None and any(d % ALIGN for d in shape[-2:]):
            odd.append(f"{name} {'x'.join(map(str, shape))}")
    if not odd:
        return None
    more = f" and {len(odd) - 4} more" if len(odd) > 4 else ""
    return (f"--fp8: torch._scaled_mm takes dimensions that are multiples of {ALIGN}; these are padded with zeros at "
            f"every call (a copy of the operands): {', '.join(odd[:4])}{more}")


def cast_with(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` in float8 ``dtype``, saturated at its largest finite value."""
    _, to_fp8_saturated, _ = _ao()
    return to_fp8_saturated(t.detach().float() * scale, dtype)


def reduce_max(amax: torch.Tensor, groups: tuple[CommGroup, ...]) -> torch.Tensor:
    for g in groups:
        if g.size > 1:
            g.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


def _note(weight: torch.Tensor, operand: str) -> tuple[str, str]:
    return getattr(weight, "fp8_name", str(id(weight))), operand


# ---- which weights, and their scales per step ------------------------------------------------------

def mark(weight: torch.Tensor, kind: str) -> None:
    """Make ``weight`` a float8 GEMM operand: ``column``, ``row`` or ``expert``."""
    weight.fp8 = kind


def kind_of(weight: torch.Tensor) -> str | None:
    return getattr(weight, "fp8", None)


def weight_scales(weight: torch.Tensor, fp8: Float8) -> WeightScales:
    """The step's scales of ``weight``; a model that no trainer refreshes (a one-rank
    model used directly) computes them from the weight itself."""
    scales = getattr(weight, "fp8_scales", None)
    if scales is None:
        if fp8.tp.size > 1:
            raise RuntimeError("float8 weight scales were not refreshed (refresh_weight_scales) before a "
                               "tensor-parallel forward")
        amax = _local_amaxes(weight.detach(), None, fp8.rowwise)
        scales = _scales_from(amax, fp8)
    return scales


def _local_amaxes(values: torch.Tensor, pieces, rowwise: bool, shape=None,
                  device: torch.device | None = None) -> list[torch.Tensor]:
    """What this rank holds of one weight: its amax (tensorwise) or its per-row ``[N]`` and
    per-column ``[K]`` amaxes (rowwise), fp32. ``pieces``: (flat values, lo) of a ZeRO-3
    shard's pieces of the weight (``shape``: its whole shape; ``device``: the rank's, where
    the amaxes are made even when the rank holds no piece), else ``values`` is it."""
    if pieces is None:
        a = values.abs().float()
        return [a.amax(1), a.amax(0)] if rowwise else [a.amax().reshape(1)]
    n, k = shape
    if not rowwise:
        amax = torch.zeros(1, device=device)
        for flat, _ in pieces:
            if flat.numel():
                amax = torch.maximum(amax, flat.abs().float().amax().reshape(1))
        return [amax]
    rows, cols = torch.zeros(n, device=device), torch.zeros(k, device=device)
    for flat, lo in pieces:
        at = torch.arange(lo, lo + flat.numel(), device=device)
        a = flat.abs().float()
        rows.scatter_reduce_(0, at // k, a, "amax")
        cols.scatter_reduce_(0, at % k, a, "amax")
    return [rows, cols]


def _scales_from(amaxes: list[torch.Tensor], fp8: Float8) -> WeightScales:
    if fp8.rowwise:
        rows, cols = amaxes
        return WeightScales(rows=fp8.scale(rows, E4M3)[:, None], cols=fp8.scale(cols, E4M3)[None, :])
    return WeightScales(tensor=fp8.scale(amaxes[0].reshape(()), E4M3))


@torch.no_grad()
def refresh_weight_scales(model: torch.nn.Module, fp8: Float8, shard: torch.Tensor | None = None,
                          reducer=None) -> int:
    """Every float8 weight's scales for the coming step, from the weights as they are
    (after the optimizer step; at start): local amaxes, reduced over the shard group
    where the weight is read from flat pieces of ``shard`` (at ``reducer``'s positions:
    ZeRO-3's parameter shard, or ZeRO-1/2's master shard before its parameter gather
    lands, rounded to the parameters' dtype as the gather rounds it: rounding is
    monotonic, so the amax is the gathered weight's), then over tp where tp splits the
    reduced dimension. One all-reduce per group. Returns how many weights it refreshed."""
    weights = [(n, p) for n, p in model.named_parameters() if kind_of(p) is not None]
    if not weights:
        return 0
    if shard is None:
        reducer = None
    amaxes = []
    for name, p in weights:
        p.fp8_name = name
        if reducer is not None and p in reducer.offsets:
            pieces = [(shard[q.at:q.end].to(p.dtype), q.lo) for q in reducer._pieces_of[p]]
            shape = tuple(getattr(p, "whole_shape", p.shape))  # ZeRO-3's parameters are empty between uses
            amaxes.append(_local_amaxes(None, pieces, fp8.rowwise, (shape[0], shape[-1] if len(shape) > 1 else 1),
                                        shard.device))
        else:
            amaxes.append(_local_amaxes(p.detach(), None, fp8.rowwise))
    if reducer is not None:  # each weight's pieces over its bucket's group
        by_group: dict[int, tuple[CommGroup, list[torch.Tensor]]] = {}
        for (_, p), a in zip(weights, amaxes):
            if p in reducer.offsets:
                group = reducer.buckets_of[p][0].group
                by_group.setdefault(id(group), (group, []))[1].extend(a)
        for group, tensors in by_group.values():
            _reduce_joined(tensors, group)
    by_etp: dict[int, tuple[CommGroup, list[torch.Tensor]]] = {}
    for (_, p), a in zip(weights, amaxes):  # an expert's slice (--etp): over its etp group, likewise
        etp = getattr(p, "etp_shard", None)
        if etp is not None and etp[1].size > 1:
            spec, group = etp
            picked = a[0] if not fp8.rowwise else (a[0] if spec.dim == 1 else a[1])
            by_etp.setdefault(id(group), (group, []))[1].append(picked)
    for group, tensors in by_etp.values():
        _reduce_joined(tensors, group)
    if fp8.tp.size > 1:  # over tp where it splits the reduced dimension (experts: never)
        split = []
        for (_, p), a in zip(weights, amaxes):
            kind = kind_of(p)
            if kind in ("column", "row"):
                if not fp8.rowwise:
                    split.append(a[0])
                else:  # rows reduce over K (split by a row layer), columns over N (by a column layer)
                    split.append(a[0] if kind == "row" else a[1])
        _reduce_joined(split, fp8.tp)
    for (name, p), a in zip(weights, amaxes):
        p.fp8_scales = scales = _scales_from(a, fp8)
        if fp8.log is not None:
            for operand, s in (("weight", scales.tensor), ("weight_rows", scales.rows), ("weight_cols", scales.cols)):
                if s is not None:
                    fp8.log.add(name, operand, s)
    return len(weights)


def _reduce_joined(tensors: list[torch.Tensor], group: CommGroup) -> None:
    """All-reduce (MAX) ``tensors`` in place as one flat tensor."""
    if group.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    group.all_reduce(flat, op=dist.ReduceOp.MAX)
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


# ---- a linear layer outside a tensor-parallel entry ---------------------------------------------

class Float8Linear(torch.autograd.Function):
    """``x W^T`` in float8 for a layer whose input is already in place (a row-parallel
    layer, a column layer at tp 1 or fed a replicated input): the three GEMMs of
    :class:`Float8`, the weight gradient deferrable (``store``, split_backward.py)."""

    @staticmethod
    def forward(ctx, x, weight, fp8, kind, store):
        y, x_scale = fp8.forward(x, weight, kind)
        ctx.save_for_backward(x, x_scale)
        ctx.weight, ctx.fp8, ctx.kind, ctx.store = weight, fp8, kind, store
        return y

    @staticmethod
    def backward(ctx, grad_out):
        from gridtrain.parallel.split_backward import weight_grad_of

        (x, x_scale), weight, fp8 = ctx.saved_tensors, ctx.weight, ctx.fp8
        grad_in, kept = fp8.grad_input(grad_out, weight, ctx.kind)
        product = fp8.grad_weight(grad_out, x, x_scale, kept)
        return grad_in, weight_grad_of(weight, grad_out, x, ctx.store, product), None, None, None


# ---- experts: per-token rows, per-expert weights, bf16 weight gradient ------------------------------

def expert_scales(weights: list[torch.Tensor], fp8: Float8, use: str) -> torch.Tensor:
    """The per-row scales ``[N]`` of one expert's (joined) weights for the forward
    (``use`` "rows") or per-column ``[K]`` for the input gradient ("cols")."""
    parts = []
    for w in weights:
        s = weight_scales(w, fp8)
        if not fp8.rowwise:
            parts.append(s.tensor.expand(w.shape[0] if use == "rows" else w.shape[1]))
        else:
            parts.append(s.rows[:, 0] if use == "rows" else s.cols[0])
    if use == "rows":
        return torch.cat(parts)
    return torch.stack(parts).amin(0)  # gate and up joined along N: the smaller scale (larger amax)


def quantised_rows(rows: torch.Tensor, fp8: Float8, dtype: torch.dtype = E4M3,
                   groups: tuple[CommGroup, ...] = ()) -> torch.Tensor:
    """``rows`` [M, K] cast per token and dequantised to fp32 (what the scaled GEMM reads);
    ``groups``: the ranks holding the rest of each row (an expert slice's etp group)."""
    q, s = fp8.cast(rows, -1, groups, dtype)
    return q.float() / s


def quantised_experts(stacked: torch.Tensor, scales: torch.Tensor, along: int) -> torch.Tensor:
    """``stacked`` [E, N, K] weights cast with ``scales`` [E, N] (``along`` 1) or [E, K]
    (``along`` 2) and dequantised to fp32."""
    s = scales.unsqueeze(along % 2 + 1)
    return cast_with(stacked, s, E4M3).float() / s
