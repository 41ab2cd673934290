"""The built-in providers that turn ``pretrain`` into ``gridtrain train``: GPT and text data.

A user's own model and data plug in by writing functions with the same signatures
(see the README's "Python API" section).
"""

from __future__ import annotations

import torch
from torch import nn

from gridtrain.config import Config
from gridtrain.data import ByteTokenizer, build_datasets, load_tokenizer, unigram_entropy
from gridtrain.distributed import DistributedContext
from gridtrain.model import GPT, init_parameters
from gridtrain.train import Batch, Datasets


def gpt_model_provider(cfg: Config, ctx: DistributedContext) -> nn.Module:
    """The GPT of ``cfg.model``, initialised layout-independently, on this rank's device."""
    model = GPT(cfg.model, tp=ctx.tp)
    init_parameters(model, cfg.training.seed)
    return model.to(device=ctx.device, dtype=ctx.param_dtype)


def text_datasets_provider(cfg: Config) -> Datasets:
    """Windows of ``seq_len + 1`` tokens over --data (or the built-in corpus)."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    train, valid, tokens = build_datasets(cfg.data.path, tokenizer, cfg.model.seq_len,
                                          valid_every=cfg.data.valid_every)
    unit = "nats/byte" if isinstance(tokenizer, ByteTokenizer) else "nats/token"
    return Datasets(train=train, valid=valid, tokenizer=tokenizer,
                    reference_loss=unigram_entropy(tokens, tokenizer.vocab_size), loss_unit=unit)


def gpt_forward_step(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed token loss of one micro-batch (the loop scales it into the global mean)."""
    return model(batch["tokens"], batch["labels"]).sum()
