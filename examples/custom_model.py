"""Train your own model and data with gridtrain's loop (the Python API).

``pretrain`` takes three functions, as Megatron-LM's does:

* ``model_provider(cfg, ctx)`` builds the model on ``ctx.device`` in ``ctx.param_dtype``;
* ``datasets_provider(cfg)`` returns ``Datasets(train, valid)``: map-style datasets
  whose items are dicts of tensors with a ``labels`` entry (IGNORE_INDEX = no loss);
* ``forward_step(model, batch)`` returns the *summed* loss of one micro-batch; the loop
  turns it into the mean over every token of the global batch, whatever the layout.

Here: a small next-token model learns to continue counting sequences (i, i+1, ... mod V).
Run it with ``python examples/custom_model.py``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.config import preset_config
from gridtrain import Datasets, pretrain

VOCAB, SEQ = 32, 16


class NextToken(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


class Counting(torch.utils.data.Dataset):
    def __init__(self, size: int, offset: int = 0):
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        seq = (i + self.offset + torch.arange(SEQ + 1)) % VOCAB
        return {"tokens": seq[:-1], "labels": seq[1:]}


def model_provider(cfg, ctx) -> nn.Module:
    torch.manual_seed(cfg.training.seed)  # the same weights on every rank
    return NextToken(VOCAB, 32).to(device=ctx.device, dtype=ctx.param_dtype)


def datasets_provider(cfg) -> Datasets:
    return Datasets(train=Counting(4096), valid=Counting(256, offset=7))


def forward_step(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")


if __name__ == "__main__":
    cfg = preset_config("tiny")
    cfg.training.steps, cfg.optim.lr, cfg.eval.eval_interval = 60, 0.05, 30
    cfg.metrics.progress = False
    result = pretrain(model_provider, datasets_provider, forward_step, cfg)
    print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, valid {result.valid_loss:.3f}")
