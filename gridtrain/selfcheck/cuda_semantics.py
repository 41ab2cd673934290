"""The self-check's GPU-semantics steps: properties that only a GPU can show, each a
short, self-contained check run in a process of its own by the runner:
``python -m gridtrain.selfcheck.cuda_semantics NAME --device D --result FILE [--tiny]``.

* ``offload``: AdamW through ``gridtrain train`` (the CLI, one rank) with and without
  ``--optimizer-offload``: the same loss at every step (the state stepped on the host
  must compute what it computes on the GPU);
* ``fp8-zero``: ``--fp8 tensorwise`` under ZeRO-1 and ZeRO-3 on two gloo ranks sharing
  the GPU: both run, with finite losses;
* ``float8-gemms``: ``torch._scaled_mm`` (``Float8.mm``, not emulated) against the
  emulated GEMM of the same float8 operands, at an aligned shape and at a token count
  that is not a multiple of 16, in both GEMM orientations (forward, weight gradient);
* ``grouped-gemm``: the experts' ``torch._grouped_mm`` path against the per-expert loop
  in bf16, with experts that get no token, and which path gridtrain picks on this GPU;
* ``efficient-attention-bwd``: the memory-efficient SDPA kernel's backward through
  gridtrain's attention blocks (the ``efficient`` kernel of ``attention_blocks``) in bf16,
  with the non-contiguous output gridtrain passes it and with a contiguous one, against
  fp64 attention, at head size 64 and 320 (above flash's 256);
* ``head-loss``: the fused, chunked head + cross entropy against the unfused one
  (``--loss-chunks 0``) at a 128K vocabulary: time, peak memory, loss;
* ``compile-fp8``: one compiled float8 run of ``gridtrain train`` with
  ``TORCH_LOGS=recompiles,graph_breaks``: how many graph breaks and recompiles.

Each writes its numbers to ``--result`` as they come (``semantics`` rows: check, case,
quantity, value, limit, ok; some a table of their own), exits non-zero when its property
does not hold, and, where the property cannot be shown here (no CUDA for a CUDA kernel,
no torchao, a GPU without float8), says why in one line under ``skipped``. ``--tiny``
shrinks the sizes for the CPU rehearsal (tests/test_selfcheck.py).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from gridtrain.selfcheck.checks import GIB, Result, relative_difference

REPO = Path(__file__).resolve().parents[2]
OFFLOAD_TOLERANCE = 1e-6  # relative, per step: the host computes what the GPU does
FLOAT8_TOLERANCE = 1e-2  # real vs emulated float8 GEMM, relative to the largest output (bf16 out)
GROUPED_TOLERANCE = 2e-2  # grouped GEMMs vs the per-expert loop, both bf16, relative to the largest value
ATTENTION_TOLERANCE = 2e-2  # bf16 kernel vs fp64, relative to the largest value
HEAD_LOSS_TOLERANCE = 1e-2  # fused vs unfused summed loss, relative
CLI_TIMEOUT_S = 300  # a CLI run's own limit; the runner's time box is the real one


def _row(result: Result, check: str, case: str, quantity: str, value, limit=None, ok: bool = True) -> bool:
    """One measured number (``semantics``), printed as it comes; returns ``ok``."""
    result.add("semantics", {"check": check, "case": case, "quantity": quantity, "value": value, "limit": limit,
                             "ok": ok})
    shown = f"{value:.3g}" if isinstance(value, float) else str(value)
    print(f"{check}: {case}: {quantity} {shown}{'' if limit is None else f' (limit {limit:g})'}"
          f"{'' if ok else ' FAILED'}")
    return ok


def _skip(result: Result, line: str) -> int:
    print(line)
    result.set("skipped", line)
    return 0


def _error(result: Result, check: str, case: str, e: BaseException) -> None:
    print(f"{check}: {case}: failed\n{traceback.format_exc()}")
    result.add("errors", {"check": check, "case": case, "error": (str(e).splitlines() or [repr(e)])[0][:300]})


def _device(args) -> torch.device:
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def capability(device: torch.device) -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def float8_problem(device: torch.device, check: str) -> str | None:
    """Why float8 cannot run here (one line), or None: torchao's float8 missing, or a GPU
    below compute capability 8.9."""
    from gridtrain.selfcheck.fp8 import torchao_missing

    problem = torchao_missing()
    if problem:
        return problem.replace("fp8: skipped", f"{check}: skipped", 1)
    from gridtrain.parallel.float8 import capability_problem

    cap = capability(device)
    why = capability_problem("tensorwise", cap, torch.cuda.get_device_name(device)) if cap is not None else None
    return f"{check}: skipped: {why}" if why else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (b: the reference), in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _rel_many(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """:func:`_rel` over several tensors at once: the largest difference relative to the
    largest reference value among them."""
    diff = max(float((x.detach().double() - y.detach().double()).abs().max()) for x, y in zip(a, b, strict=True))
    scale = max(float(y.detach().double().abs().max()) for y in b)
    return diff / max(scale, 1e-30)


# ---- gridtrain train through its CLI ------------------------------------------------------------------

def train_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "gridtrain", "train", "--no-progress", "--sample-tokens", "0", "--eval-interval",
            "0", "--eval-iters", "1", *flags]


def run_cli(command: list[str], env: dict | None = None) -> tuple[int, str]:
    """(exit code, stdout and stderr together) of a CLI run from the repository root."""
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    print(f"$ {' '.join(command)}", flush=True)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          env={**base, **(env or {})})
    return done.returncode, done.stdout + done.stderr


def metrics_losses(path: Path) -> list[float]:
    """The ``loss`` of every step of a ``--metrics-file``."""
    if not path.exists():
        return []
    import json

    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


# ---- offload ------------------------------------------------------------------------------------------

def offload(args, result: Result) -> int:
    """AdamW in fp32 on the tiny Llama, one rank, with and without ``--optimizer-offload``,
    both with ``--zero 1`` so that the same optimizer (gridtrain's flat AdamW) runs with
    its state on the GPU and on the host: every step's loss within 1e-6 (relative)."""
    steps = 4 if args.tiny else 20
    case = f"AdamW, ZeRO-1, fp32, llama-tiny, one rank on {args.device}, {steps} steps"
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (("state on the device", []), ("state offloaded", ["--optimizer-offload"])):
            metrics = Path(tmp) / f"{len(losses)}.jsonl"
            code, out = run_cli(train_command("--model", "llama-tiny", "--device", args.device, "--dtype", "fp32",
                                              "--optimizer", "adamw", "--zero", "1", "--steps", str(steps),
                                              "--metrics-file", str(metrics), *extra))
            losses[label] = metrics_losses(metrics)
            if code != 0 or len(losses[label]) != steps:
                print(_tail(out))
                result.add("errors", {"check": "offload", "case": label,
                                      "error": f"exit code {code}, {len(losses[label])} of {steps} steps"})
                return 1
    here, host = losses["state on the device"], losses["state offloaded"]
    result.set("offload", {"steps": steps, "losses": here, "losses_offloaded": host,
                           "max_abs_diff": max(abs(a - b) for a, b in zip(here, host))})
    if args.device == "cpu":
        print("offload: on cpu the state is in host memory either way (a rehearsal of the check itself)")
    diff = relative_difference(host, here)
    ok = _row(result, "offload", case, "max relative loss difference, offloaded vs on the device", diff,
              OFFLOAD_TOLERANCE, diff <= OFFLOAD_TOLERANCE)
    ok &= _row(result, "offload", case, "loss went down", here[-1] < here[0], ok=here[-1] < here[0])
    return 0 if ok else 1


# ---- fp8 under ZeRO -------------------------------------------------------------------------------------

def fp8_zero(args, result: Result) -> int:
    """``--fp8 tensorwise`` with ZeRO-1 and with ZeRO-3 on two gloo ranks sharing the
    device (dp 2): each exits 0 with a finite loss at every step."""
    problem = float8_problem(_device(args), "fp8-zero")
    if problem:
        return _skip(result, problem)
    steps = 3 if args.tiny else 4
    failed, curves = 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        for zero in (1, 3):
            case = f"--fp8 tensorwise --zero {zero}, dp 2 (2 gloo ranks on {args.device}), bf16, {steps} steps"
            metrics = Path(tmp) / f"zero{zero}.jsonl"
            code, out = run_cli(train_command("--model", "llama-tiny", "--nproc", "2", "--dp", "2", "--backend",
                                              "gloo", "--device", args.device, "--dtype", "bf16", "--fp8",
                                              "tensorwise", "--zero", str(zero), "--steps", str(steps),
                                              "--metrics-file", str(metrics)))
            losses = metrics_losses(metrics)
            finite = len(losses) == steps and all(math.isfinite(x) for x in losses)
            if code != 0:
                print(_tail(out))
            ok = _row(result, "fp8-zero", case, "exit code", code, ok=code == 0)
            ok &= _row(result, "fp8-zero", case, "steps with a finite loss", f"{sum(map(math.isfinite, losses))} of "
                       f"{steps}", ok=finite)
            if losses:
                _row(result, "fp8-zero", case, "final loss", losses[-1], ok=finite)
            curves[zero] = losses
            failed += not ok
    if curves.get(1) and curves.get(3) and len(curves[1]) == len(curves[3]):
        _row(result, "fp8-zero", "ZeRO-3 vs ZeRO-1 (reported)", "max relative loss difference",
             relative_difference(curves[3], curves[1]))
    return 1 if failed else 0


# ---- float8 GEMMs -------------------------------------------------------------------------------------

# (M tokens, K in, N out): aligned, and a token count that is not a multiple of 16
FLOAT8_SHAPES, TINY_FLOAT8_SHAPES = ((256, 512, 1024), (1000, 512, 1024)), ((32, 64, 48), (40, 64, 48))


def _float8_operands(f8, orientation: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """The float8 operands and scales of one GEMM as gridtrain's linear casts them:
    ``forward`` x W^T ([M, K] by [K, N]), or ``weight gradient`` g^T x ([N, M] by [M, K]:
    the token count is the reduction)."""
    from gridtrain.parallel.float8 import E4M3

    if orientation == "forward":
        if f8.rowwise:
            xq, xs = f8.cast(x, -1, (), E4M3)
            wq, ws = f8.cast(w, -1, (), E4M3)
            return xq, xs, wq.t(), ws.t()
        xq, xs = f8.cast(x, None, (), E4M3)
        wq, ws = f8.cast(w, None, (), E4M3)
        return xq, xs, wq.t(), ws
    if f8.rowwise:  # along the tokens
        gq, gs = f8.cast(g, 0, (), E4M3)
        xq, xs = f8.cast(x, 0, (), E4M3)
        return gq.t(), gs.t(), xq, xs
    gq, gs = f8.cast(g, None, (), f8.grad_dtype)
    xq, xs = f8.cast(x, None, (), E4M3)
    return gq.t(), gs, xq, xs


def float8_gemms(args, result: Result) -> int:
    """``Float8(recipe, emulate=False).mm`` (``torch._scaled_mm``) against
    ``emulate=True`` on the same float8 operands, tensorwise and rowwise, forward and
    weight-gradient orientations, at an aligned and an unaligned token count: the largest
    output difference relative to the largest output (bf16 out), and that no shape
    raises. The float8 operands' own error against bf16 is reported beside it."""
    device = _device(args)
    problem = float8_problem(device, "float8-gemms")
    if problem is None and device.type != "cuda":
        problem = ("float8-gemms: skipped: torch._scaled_mm's float8 kernels need a CUDA GPU (compute capability "
                   "8.9+); off CUDA gridtrain emulates them")
    if problem:
        return _skip(result, problem)
    from gridtrain.parallel.float8 import RECIPES, Float8

    torch.manual_seed(0)
    failed = 0
    for recipe in RECIPES:
        real, emulated = Float8(recipe, emulate=False), Float8(recipe, emulate=True)
        for m, k, n in TINY_FLOAT8_SHAPES if args.tiny else FLOAT8_SHAPES:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w = (torch.randn(n, k, device=device) * 0.05).to(torch.bfloat16)
            g = (torch.randn(m, n, device=device) * 1e-3).to(torch.bfloat16)
            for orientation in ("forward", "weight gradient"):
                shape = f"{m}x{k}x{n}" if orientation == "forward" else f"{n}x{m}x{k}"
                odd = "" if m % 16 == 0 else " (tokens not a multiple of 16)"
                case = f"{recipe}, {orientation}, MxKxN {shape}{odd}"
                try:
                    a, a_scale, b, b_scale = _float8_operands(real, orientation, x, w, g)
                    got = real.mm(a, a_scale, b, b_scale, torch.bfloat16, fast=orientation == "forward")
                    want = emulated.mm(a, a_scale, b, b_scale, torch.bfloat16)
                    _sync(device)
                except Exception as e:  # noqa: BLE001 -- reported; the step fails
                    _error(result, "float8-gemms", case, e)
                    failed += 1
                    continue
                exact = (x @ w.t()) if orientation == "forward" else (g.t() @ x)
                diff = _rel(got, want)
                ok = tuple(got.shape) == tuple(want.shape) and bool(torch.isfinite(got).all())
                failed += not _row(result, "float8-gemms", case, "real vs emulated, relative", diff,
                                   FLOAT8_TOLERANCE, ok and diff <= FLOAT8_TOLERANCE)
                _row(result, "float8-gemms", case, "float8 vs bf16 operands (reported)", _rel(got, exact))
    return 1 if failed else 0


# ---- grouped GEMMs of the experts ---------------------------------------------------------------------

# (d_model, expert width, experts, top k, tokens): Qwen3-30B-A3B's expert shape, fewer
# experts; a tiny stand-in for the CPU
GROUPED_RUN, TINY_GROUPED_RUN = (2048, 768, 16, 4, 4096), (64, 32, 8, 2, 64)


def _moe_layer(device: torch.device, d: int, h: int, experts: int, top_k: int):
    from gridtrain.config import preset_config
    from gridtrain.models.moe import MoE
    from gridtrain.parallel.experts import ExpertParallel
    from gridtrain.parallel.tensor_parallel import TensorParallel

    cfg = dataclasses.replace(preset_config("moe-tiny").model, d_model=d, moe_ffn_hidden=h, n_experts=experts,
                              moe_top_k=top_k)
    torch.manual_seed(0)
    layer = MoE(cfg, 0, TensorParallel(), ExpertParallel())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer.to(device=device, dtype=torch.bfloat16)


def _expert_pass(layer, x: torch.Tensor, chosen, weights, dout, grouped: bool) -> list[torch.Tensor]:
    """Output, input gradient and every expert parameter's gradient of the routed experts
    on ``x`` (the routing given), by grouped GEMMs or by the per-expert loop."""
    from gridtrain.parallel.experts import dispatch_combine

    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    n = layer.cfg.n_experts
    if grouped:
        out = dispatch_combine(x, chosen, weights, n, layer.ep, None, run_grouped=layer._run_grouped)[0]
    else:
        out = dispatch_combine(x, chosen, weights, n, layer.ep, lambda e, rows: layer.experts[str(e)](rows))[0]
    out.backward(dout)
    return [out.detach(), x.grad, *(p.grad if p.grad is not None else torch.zeros_like(p)
                                    for p in layer.experts.parameters())]


def _timed(device: torch.device, run, repeats: int = 3) -> float:
    """Median seconds of ``run()`` after one warm-up (CUDA events on a GPU)."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def grouped_gemm(args, result: Result) -> int:
    """The experts' grouped GEMMs (``torch._grouped_mm``) against the per-expert loop in
    bf16, forward and backward, with the first, a middle and the last expert getting no
    token: the largest difference of the output, the input gradient and the experts'
    weight gradients (relative to the largest value), the unused experts' gradients
    exactly zero, both against an fp32 loop beside it; the device's compute capability
    and the path gridtrain picks there (``experts.grouped_gemm_fits``)."""
    from gridtrain.parallel import experts

    device = _device(args)
    d, h, n_experts, top_k, tokens = TINY_GROUPED_RUN if args.tiny else GROUPED_RUN
    cap = capability(device)
    picks = experts.grouped_gemm_fits(torch.bfloat16, device, d, h)
    case = f"bf16, {tokens} tokens, {n_experts} experts of {d}x{h}, top {top_k}, experts 0, {n_experts // 2}, " \
           f"{n_experts - 1} get none"
    where = f"compute capability {cap[0]}.{cap[1]}" if cap else device.type
    _row(result, "grouped-gemm", where, "gridtrain picks", "grouped GEMM" if picks else "per-expert loop")
    fast_on = getattr(experts, "grouped_gemm_fast_on", None)
    if cap is not None and fast_on is not None:
        _row(result, "grouped-gemm", where, "torch runs it as a grouped kernel here", bool(fast_on(cap)))
    layer = _moe_layer(device, d, h, n_experts, top_k)
    gen = torch.Generator(device="cpu").manual_seed(1)
    unused = {0, n_experts // 2, n_experts - 1}
    used = torch.tensor([e for e in range(n_experts) if e not in unused])
    chosen = torch.stack([used[torch.randperm(len(used), generator=gen)[:top_k]] for _ in range(tokens)]).to(device)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(device, torch.bfloat16)
    x = torch.randn(tokens, d, generator=gen).to(device, torch.bfloat16)
    dout = torch.randn(tokens, d, generator=gen).to(device, torch.bfloat16)
    try:
        grouped = _expert_pass(layer, x, chosen, weights, dout, grouped=True)
        _sync(device)
    except Exception as e:  # noqa: BLE001 -- reported; fails the step where gridtrain would take this path
        _error(result, "grouped-gemm", case, e)
        return 1 if picks else 0
    loop = _expert_pass(layer, x, chosen, weights, dout, grouped=False)
    wide = copy.deepcopy(layer).float()
    reference = _expert_pass(wide, x.float(), chosen, weights.float(), dout.float(), grouped=False)
    names = ("output", "input gradient")
    ok = True
    for i, name in enumerate(names):
        ok &= _row(result, "grouped-gemm", case, f"{name}: grouped vs loop", _rel(grouped[i], loop[i]),
                   GROUPED_TOLERANCE, _rel(grouped[i], loop[i]) <= GROUPED_TOLERANCE)
        _row(result, "grouped-gemm", case, f"{name}: grouped vs fp32 loop (loop: {_rel(loop[i], reference[i]):.3g})",
             _rel(grouped[i], reference[i]))
    diff = _rel_many(grouped[2:], loop[2:])
    ok &= _row(result, "grouped-gemm", case, "weight gradients: grouped vs loop", diff, GROUPED_TOLERANCE,
               diff <= GROUPED_TOLERANCE)
    _row(result, "grouped-gemm", case, f"weight gradients: grouped vs fp32 loop (loop: "
         f"{_rel_many(loop[2:], reference[2:]):.3g})", _rel_many(grouped[2:], reference[2:]))
    per_expert = len(list(layer.experts["0"].parameters()))
    stray = [e for e in sorted(unused) for gr in grouped[2 + e * per_expert:2 + (e + 1) * per_expert] if gr.any()]
    ok &= _row(result, "grouped-gemm", case, "experts without tokens with a nonzero gradient", len(stray),
               ok=not stray)
    finite = all(bool(torch.isfinite(t).all()) for t in grouped)
    ok &= _row(result, "grouped-gemm", case, "all finite", finite, ok=finite)
    for label, flag in (("grouped", True), ("loop", False)):
        seconds = _timed(device, lambda: _expert_pass(layer, x, chosen, weights, dout, grouped=flag))
        _row(result, "grouped-gemm", case, f"{label} ms (forward + backward)", seconds * 1e3)
    return 0 if ok else 1


# ---- the memory-efficient attention kernel's backward ----------------------------------------------------

# (batch, heads, kv heads, tokens); head sizes and whether causal
ATTENTION_RUN, TINY_ATTENTION_RUN = (2, 8, 2, 1024), (1, 4, 2, 64)
ATTENTION_CASES = ((64, True), (320, True), (320, False))


def _reference_attention(q, k, v, dout, causal: bool, scale: float):
    """Output and gradients of attention in fp64 (math, on the device)."""
    from gridtrain.parallel.attention_blocks import every_head

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    heads = q.shape[1]
    scores = q64 @ every_head(k64, heads).transpose(-1, -2) * scale
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.softmax(scores, -1) @ every_head(v64, heads)
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _torch_sdpa(q, k, v, dout, causal: bool, scale: float):
    """torch's own SDPA with the memory-efficient backend forced, for comparison."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gridtrain.parallel.attention_blocks import every_head

    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    heads = q.shape[1]
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qq, every_head(kk, heads), every_head(vv, heads),
                                                               is_causal=causal, scale=scale)
        out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad


def efficient_attention_bwd(args, result: Result) -> int:
    """gridtrain's ``efficient`` attention block (``attention_blocks.block_forward`` /
    ``block_backward``: ``_scaled_dot_product_efficient_attention`` and its backward, the
    log-sum-exp padded to its blocks of 32, the shared key/value heads repeated and their
    gradients summed back) in bf16, with the output laid out as gridtrain keeps it
    (``[b, s, heads, d]`` in memory: not contiguous as ``[b, heads, s, d]``), and again
    with a contiguous one (context parallelism's merged output: the kernel's backward
    assumes the forward's row stride, ``attention_blocks.efficient_backward_inputs``),
    against fp64 attention: the output's and dq, dk, dv's largest errors relative to
    their largest value, at head size 64 and 320 (flash takes at most 256); torch's own
    SDPA with the efficient backend forced beside it (reported). Off CUDA the check rehearses itself
    with the CPU's flash kernel and reports the step skipped."""
    from gridtrain.parallel import attention_blocks as blocks

    device = _device(args)
    kernel = "efficient" if device.type == "cuda" else "flash_cpu"
    b, heads, kv_heads, n = TINY_ATTENTION_RUN if args.tiny else ATTENTION_RUN
    failed = 0
    for d, causal in ATTENTION_CASES:
        case = f"{kernel} kernel, bf16, {b}x{heads} heads ({kv_heads} kv) x {n} tokens, head size {d}, " \
               f"{'causal' if causal else 'not causal'}"
        g = torch.Generator(device="cpu").manual_seed(d + causal)
        q = torch.randn(b, heads, n, d, generator=g).to(device, torch.bfloat16)
        k = torch.randn(b, kv_heads, n, d, generator=g).to(device, torch.bfloat16)
        v = torch.randn(b, kv_heads, n, d, generator=g).to(device, torch.bfloat16)
        dout = torch.randn(b, heads, n, d, generator=g).to(device, torch.bfloat16)
        scale = 1.0 / math.sqrt(d)
        try:
            out, lse = blocks.block_forward(kernel, q, k, v, causal, scale)
            laid_out = torch.empty(b, n, heads, d, device=device, dtype=out.dtype).transpose(1, 2)
            laid_out.copy_(out)  # as _DocumentAttention keeps it: [b, s, heads, d] in memory
            grads = blocks.block_backward(kernel, dout, q, k, v, laid_out, lse, causal, scale)
            contiguous = blocks.block_backward(kernel, dout, q, k, v, out.contiguous(), lse, causal, scale)
            _sync(device)
        except Exception as e:  # noqa: BLE001 -- reported; the step fails
            _error(result, "efficient-attention-bwd", case, e)
            failed += 1
            continue
        ref = _reference_attention(q, k, v, dout, causal, scale)
        ok = True
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
            err = _rel(got, want)
            ok &= _row(result, "efficient-attention-bwd", case, f"{name} vs fp64, relative", err, ATTENTION_TOLERANCE,
                       err <= ATTENTION_TOLERANCE and bool(torch.isfinite(got).all()))
        # out contiguous as [b, heads, s, d] (context parallelism's merged output): the same gradients
        err = max(_rel(got, want) for got, want in zip(contiguous, ref[1:]))
        ok &= _row(result, "efficient-attention-bwd", case, "worst of dq, dk, dv vs fp64 with out contiguous",
                   err, ATTENTION_TOLERANCE, err <= ATTENTION_TOLERANCE)
        same = max(float((x.float() - y.float()).abs().max()) for x, y in zip(grads, contiguous))
        _row(result, "efficient-attention-bwd", case, "largest gradient difference, out non-contiguous vs "
             "contiguous (reported)", same)
        if device.type == "cuda":
            try:
                theirs = _torch_sdpa(q, k, v, dout, causal, scale)
                worst = max(_rel(got, want) for got, want in zip(theirs, ref))
                _row(result, "efficient-attention-bwd", case, "torch SDPA (efficient backend): worst of out, dq, "
                     "dk, dv vs fp64 (reported)", worst)
            except Exception as e:  # noqa: BLE001 -- torch's own, for comparison only
                _row(result, "efficient-attention-bwd", case, "torch SDPA (efficient backend) (reported)",
                     f"raised {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        failed += not ok
    if device.type != "cuda":
        print("efficient-attention-bwd: the comparison above rehearsed the check with the CPU's flash kernel")
        result.set("skipped", "efficient-attention-bwd: skipped: the memory-efficient attention kernel needs CUDA "
                              "(rehearsed with the CPU's flash kernel)")
    return 1 if failed else 0


# ---- the chunked head loss --------------------------------------------------------------------------

# (vocabulary, d_model, tokens): a Llama 3 class vocabulary at 8K tokens; a tiny stand-in
HEAD_RUN, TINY_HEAD_RUN = (131072, 2048, 8192), (1024, 64, 256)


def head_loss(args, result: Result) -> int:
    """The fused, chunked head + cross entropy (``models/head_loss.fused_head_loss``, its
    automatic chunks) against the unfused head and torch's cross entropy (what
    ``--loss-chunks 0`` runs: ``parallel_lm_logits`` then ``vocab_parallel_cross_entropy``)
    on the same bf16 hidden states and head: forward + backward time (median of 3 after a
    warm-up; CUDA events on a GPU), peak memory above what was allocated before (CUDA),
    their ratios, and the summed losses' and gradients' differences. Measures only: fails
    on a crash or on losses more than 1e-2 apart (relative)."""
    from gridtrain.models.head_loss import chunk_rows, fused_head_loss
    from gridtrain.parallel.tensor_parallel import TensorParallel, parallel_lm_logits, vocab_parallel_cross_entropy

    device = _device(args)
    vocab, d, tokens = TINY_HEAD_RUN if args.tiny else HEAD_RUN
    tp = TensorParallel()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, tokens, d, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, d, generator=g) * 0.02).to(device, torch.bfloat16)
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    case = f"bf16, vocabulary {vocab:,}, d {d}, {tokens:,} tokens"
    rows = chunk_rows(tokens, vocab, None)
    _row(result, "head-loss", case, "fused: chunks (automatic)", math.ceil(tokens / rows))

    def fused():
        xx, ww = x.detach().requires_grad_(), weight.detach().requires_grad_()
        loss = fused_head_loss(xx, ww, labels, vocab, tp)
        loss.backward()
        return loss.detach(), xx.grad, ww.grad

    def unfused():
        xx, ww = x.detach().requires_grad_(), weight.detach().requires_grad_()
        loss = vocab_parallel_cross_entropy(parallel_lm_logits(xx, ww, tp), labels, vocab, tp).sum()
        loss.backward()
        return loss.detach(), xx.grad, ww.grad

    measured = {}
    for name, run in (("fused", fused), ("unfused", unfused)):
        try:
            seconds = _timed(device, run)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            outputs = run()
            _sync(device)
            peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        except Exception as e:  # noqa: BLE001 -- reported; the step fails
            _error(result, "head-loss", f"{name}, {case}", e)
            return 1
        measured[name] = (seconds, peak, outputs)
        _row(result, "head-loss", case, f"{name}: ms (forward + backward)", seconds * 1e3)
        if peak is not None:
            _row(result, "head-loss", case, f"{name}: peak GiB above the inputs", peak / GIB)
        del outputs
    (fs, fp, fo), (us, up, uo) = measured["fused"], measured["unfused"]
    _row(result, "head-loss", case, "speed, fused / unfused", us / fs)
    if fp is not None and up:
        _row(result, "head-loss", case, "peak memory, fused / unfused", fp / up)
    loss_diff = abs(float(fo[0]) - float(uo[0])) / max(abs(float(uo[0])), 1e-30)
    ok = _row(result, "head-loss", case, "summed loss, fused vs unfused, relative", loss_diff, HEAD_LOSS_TOLERANCE,
              loss_diff <= HEAD_LOSS_TOLERANCE and math.isfinite(float(fo[0])))
    _row(result, "head-loss", case, "input gradient, fused vs unfused (reported)", _rel(fo[1], uo[1]))
    _row(result, "head-loss", case, "head gradient, fused vs unfused (reported)", _rel(fo[2], uo[2]))
    result.set("head_loss", {"vocab": vocab, "d_model": d, "tokens": tokens, "fused_ms": fs * 1e3,
                             "unfused_ms": us * 1e3, "fused_peak_gib": fp / GIB if fp is not None else None,
                             "unfused_peak_gib": up / GIB if up is not None else None, "loss_rel_diff": loss_diff})
    return 0 if ok else 1


# ---- a compiled float8 run: graph breaks and recompiles ----------------------------------------------------

GRAPH_BREAK = re.compile(r"\[__graph_breaks\] Graph break")
RECOMPILE = re.compile(r"\[__recompiles\] Recompiling function")
GUARD = re.compile(r"- \d+/\d+: ")  # a failed guard's line: "- 0/0: ___check_obj_id(...)"


def count_compile_events(text: str) -> dict:
    """Graph breaks and recompiles in a run's output under
    ``TORCH_LOGS=recompiles,graph_breaks`` (torch prefixes every line of a record with its
    artifact, ``[__graph_breaks]`` or ``[__recompiles]``): records (the first line of each)
    and tagged lines, and the first few reasons."""
    lines = text.splitlines()
    breaks = [line for line in lines if GRAPH_BREAK.search(line)]
    recompiles = [line for line in lines if RECOMPILE.search(line)]
    reasons = [line.split("Graph Break Reason:", 1)[1].strip() for line in lines
               if "[__graph_breaks]" in line and "Graph Break Reason:" in line]
    guards = [line.split("[__recompiles]", 1)[1].strip() for line in lines
              if "[__recompiles]" in line and GUARD.match(line.split("[__recompiles]", 1)[1].strip())]
    return {"graph_breaks": len(breaks), "recompiles": len(recompiles),
            "graph_break_lines": sum("[__graph_breaks]" in line for line in lines),
            "recompile_lines": sum("[__recompiles]" in line for line in lines),
            "graph_break_reasons": reasons[:8], "recompile_guards": guards[:8],
            "graph_break_sites": [GRAPH_BREAK.split(line, 1)[1].strip() for line in breaks[:8]],
            "recompiled": [RECOMPILE.split(line, 1)[1].strip() for line in recompiles[:8]]}


def compile_fp8(args, result: Result) -> int:
    """``gridtrain train --model llama-tiny --compile --fp8 tensorwise --dtype bf16
    --steps 5`` with ``TORCH_LOGS=recompiles,graph_breaks``: the number of graph breaks
    and recompiles in its output (reported, with their first reasons); fails only when
    the run does."""
    problem = float8_problem(_device(args), "compile-fp8")
    if problem:
        return _skip(result, problem)
    steps = 3 if args.tiny else 5
    case = f"llama-tiny, --compile --fp8 tensorwise, bf16, {steps} steps on {args.device}"
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        code, out = run_cli(train_command("--model", "llama-tiny", "--compile", "--fp8", "tensorwise", "--dtype",
                                          "bf16", "--steps", str(steps), "--device", args.device, "--metrics-file",
                                          str(metrics)), env={"TORCH_LOGS": "recompiles,graph_breaks"})
        losses = metrics_losses(metrics)
    counts = count_compile_events(out)
    result.set("compile", {**counts, "losses": losses, "exit_code": code})
    for what in ("graph_break_sites", "graph_break_reasons", "recompiled", "recompile_guards"):
        for line in counts[what]:
            print(f"{what.replace('_', ' ')}: {line}")
    _row(result, "compile-fp8", case, "graph breaks", counts["graph_breaks"])
    _row(result, "compile-fp8", case, "recompiles", counts["recompiles"])
    _row(result, "compile-fp8", case, "log lines (graph breaks, recompiles)",
         f"{counts['graph_break_lines']}, {counts['recompile_lines']}")
    finite = len(losses) == steps and all(math.isfinite(x) for x in losses)
    ok = _row(result, "compile-fp8", case, "exit code", code, ok=code == 0)
    ok &= _row(result, "compile-fp8", case, "steps with a finite loss", f"{sum(map(math.isfinite, losses))} of {steps}",
               ok=finite)
    if code != 0:
        print(_tail(out, 60))
    return 0 if ok else 1


CHECKS = {"offload": offload, "fp8-zero": fp8_zero, "float8-gemms": float8_gemms, "grouped-gemm": grouped_gemm,
          "efficient-attention-bwd": efficient_attention_bwd, "head-loss": head_loss, "compile-fp8": compile_fp8}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gridtrain.selfcheck.cuda_semantics")
    ap.add_argument("name", choices=sorted(CHECKS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--result", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU rehearsal)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="unused (the runner passes it to every check)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return CHECKS[args.name](args, Result(args.result))


if __name__ == "__main__":
    sys.exit(main())
