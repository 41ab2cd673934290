"""The plain PyTorch loop gridtrain is measured against, and the throughput arithmetic.

The loop is what a careful PyTorch user writes for one device: the same ``Decoder``
(gridtrain's model used as a plain ``nn.Module``, so both loops run the same kernels;
on a GPU built there and drawn from the same distributions on the device, where
gridtrain's host-side reference draw would take seconds of a 1B model's run),
fp32 weights under ``torch.autocast`` for bf16, ``torch.optim.AdamW`` with
``fused=True`` on CUDA, the gradient norm clipped to 1.0, ``torch.compile`` of the whole
model when asked, and the loss read to the host each step as a loop that logs does.
Its tokens are random ids made on the device before the loop: it reads no data.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from gridtrain.config import ModelConfig
from gridtrain.models.decoder import Decoder, _init_std, init_parameters


def plain_loop(model_cfg: ModelConfig, device: torch.device, dtype: str, micro_batch_size: int, steps: int,
               compile: bool = False, seed: int = 0) -> tuple[list[float], int]:
    """Train ``steps`` steps of one micro-batch; returns each step's seconds and the peak
    device memory (bytes; 0 off CUDA)."""
    torch.manual_seed(seed)
    if device.type == "cuda":
        with torch.device(device):
            model = Decoder(model_cfg)
        init_on_device(model, model_cfg)
    else:
        model = Decoder(model_cfg)
        init_parameters(model, seed)
    model.to(device=device, dtype=torch.float64 if dtype == "fp64" else torch.float32)
    step_model = torch.compile(model) if compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  fused=device.type == "cuda")
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    autocast = (lambda: torch.autocast(device.type, dtype=low)) if low else contextlib.nullcontext
    s = model_cfg.seq_len
    tokens = torch.randint(0, model_cfg.vocab_size, (steps, micro_batch_size, s + 1), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(steps):
        began = time.perf_counter()
        with autocast():
            loss = step_model(tokens[i, :, :-1], tokens[i, :, 1:]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return times, peak


@torch.no_grad()
def init_on_device(model: Decoder, model_cfg: ModelConfig) -> None:
    """Each parameter drawn where it is, from the distribution gridtrain's initialisation
    draws it from (N(0, std) or the constant; other values: the speed is the same)."""
    for name, param in model.named_parameters():
        std = _init_std(name, param, model_cfg)
        if std is None:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            param.normal_(0.0, std)


def median_after(times: list[float], warmup: int) -> float:
    """The median step time after the first ``warmup`` steps (all of them if too few)."""
    kept = times[warmup:] or times
    return statistics.median(kept)


def throughput_row(model: str, compile: bool, loop: str, step_s: float, tokens_per_step: int,
                   flops_per_token: float, peak_tflops: float | None) -> dict:
    """tokens/s, model TFLOP/s and MFU of one loop's median step."""
    tokens_per_s = tokens_per_step / step_s
    tflops = tokens_per_s * flops_per_token / 1e12
    return {"model": model, "compile": compile, "loop": loop, "tokens_per_step": tokens_per_step,
            "step_ms": step_s * 1e3, "tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None}
