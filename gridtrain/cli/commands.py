"""What the ``train`` and ``generate`` commands do once their flags are parsed and valid.

``train`` runs :func:`gridtrain.training.loop.pretrain` with the built-in Decoder and text
providers, either in this process (one rank, or one torchrun worker) or on ``--nproc``
spawned workers, and ends with a sample of the trained model's text.
"""

from __future__ import annotations

import argparse

import torch

from gridtrain import checkpoint
from gridtrain.runtime import launch, startup, warm
from gridtrain.config import Config, under_torchrun
from gridtrain.data import load_tokenizer
from gridtrain.parallel.distributed import shutdown
from gridtrain.checkpoint.huggingface import load_model, open_source, source_tokenizer
from gridtrain.runtime.launch import backend_for, resolve_device_type
from gridtrain.models.decoder import Decoder, generate
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider
from gridtrain.training.loop import pretrain
from gridtrain.runtime.watchdog import backstop_timeout_s


def train_worker(rank: int, world_size: int, cfg: Config) -> dict:
    """One rank's whole run; returns what the parent reports (picklable)."""
    result = pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg)
    if cfg.sample.sample_tokens > 0:
        result.gather_weights()  # ZeRO-3: the whole stage on every rank, while it is gathered to rank 0
        weights = checkpoint.gather_model(result.model, result.ctx)  # whatever the layout
        if result.ctx.rank == 0:
            print_sample(whole_model(cfg, weights), cfg)
    return {"losses": result.losses, "valid_loss": result.valid_loss}


def train_command(cfg: Config) -> int:
    nproc = cfg.parallel.nproc
    if nproc is None or under_torchrun():  # this process is the (only, or torchrun's) worker
        try:
            train_worker(0, 1, cfg)
        finally:
            shutdown()
        return 0
    ckpt, data = cfg.checkpoint, cfg.data
    if ckpt.save or ckpt.load or ckpt.init_from:  # DCP (about 1 s of CPU) imported once, in the warm server
        warm.preload("gridtrain.checkpoint.dcp_io")
    if data.path is None and data.tokenizer is None and not ckpt.init_from:  # the built-in corpus read once, not per rank
        warm.preload("gridtrain.data.corpora:builtin_bytes")
    launch.run_workers(train_worker, nproc, (cfg,), backend=backend_for(resolve_device_type(cfg.training.device), cfg.training.backend),
                       collective_timeout_s=backstop_timeout_s(cfg.training.dist_timeout_s),
                       env=startup.launch_environment())  # the workers time their start-up from this command's
    return 0


def whole_model(cfg: Config, weights: dict[str, torch.Tensor]) -> Decoder:
    """The unsplit Decoder with the given whole weights, on this process's device."""
    model = Decoder(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            saved = weights[name]
            p[: saved.shape[0]].copy_(saved)  # padding rows stay zero
        for name, b in checkpoint.model_buffers(model):  # a MoE's expert bias
            b.copy_(weights[name])
    return model.to(device=resolve_device_type(cfg.training.device), dtype=sampling_dtype(cfg))


def sampling_dtype(cfg: Config) -> torch.dtype:
    """Samples are drawn in fp32 (fp64 for fp64 runs), whatever the training dtype."""
    return torch.float64 if cfg.training.dtype == "fp64" else torch.float32


def print_sample(model: Decoder, cfg: Config) -> None:
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    text = sample_text(model, tokenizer, cfg.sample.prompt, cfg.sample.sample_tokens,
                       cfg.sample.temperature, cfg.sample.top_k, cfg.training.seed)
    print(f"\n--- sample ({cfg.sample.sample_tokens} tokens, prompt {cfg.sample.prompt!r}) ---")
    print(text)
    print("--- end of sample ---", flush=True)


def sample_text(model: Decoder, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                top_k: int | None, seed: int) -> str:
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id or 0]
    device = next(model.parameters()).device
    prompt_ids = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                   generator=gen)
    return tokenizer.decode(out[0].tolist())


def generate_command(args: argparse.Namespace) -> int:
    """Sample from a checkpoint or a Hugging Face directory, with its own tokenizer
    (``tokenizer.json`` beside the weights, or the run's) unless ``--tokenizer`` is given."""
    source = open_source(args.load, "--load")
    tokenizer = source_tokenizer(source, getattr(args, "tokenizer", None))
    dtype = torch.float64 if source.dtype == torch.float64 else torch.float32  # as sampling_dtype
    model = load_model(args.load, device=resolve_device_type(args.device), dtype=dtype)
    print(sample_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                      args.top_k, args.seed))
    return 0
