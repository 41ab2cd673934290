"""The GPT-2 decoder: pre-LayerNorm blocks, GELU MLP, learned positions, tied embeddings.

Two properties matter more than anything else here:

* **Global parameter names.** Blocks live in a ``ModuleDict`` keyed by their global
  layer index, so ``blocks.7.attn.qkv.weight`` means the same tensor whichever stage
  holds layer 7. Checkpoints and the initialisation below key on these names.
* **Layout-independent initialisation.** :func:`init_parameters` draws every parameter
  whole from a generator seeded by (seed, name), as Megatron's CPU initialisation does,
  so any split of the model over devices starts from the same numbers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.config import ModelConfig

IGNORE_INDEX = -100


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.weight.residual_projection = True  # scaled init, see init_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_size)
        self.proj = nn.Linear(cfg.ffn_size, cfg.d_model)
        self.proj.weight.residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layernorm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layernorm_eps)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    """Token plus learned position embedding; the token table is padded (see ModelConfig)."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int):
        super().__init__()
        self.word = nn.Embedding(padded_vocab, cfg.d_model)
        self.word.weight.vocab_rows = cfg.vocab_size  # rows past this are padding
        self.position = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.word(tokens) + self.position(positions))


class GPT(nn.Module):
    """A GPT-2 decoder, or the slice of one that a pipeline stage holds.

    ``pre_process`` (the embedding) and ``post_process`` (final norm, head and loss) follow
    Megatron's model_provider flags; ``layer_ids`` are the global indices of the blocks
    this module holds.
    """

    def __init__(self, cfg: ModelConfig, *, layer_ids: Iterable[int] | None = None,
                 pre_process: bool = True, post_process: bool = True, tp: int = 1):
        super().__init__()
        self.cfg = cfg
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = cfg.padded_vocab_size(tp)
        ids = range(cfg.n_layer) if layer_ids is None else layer_ids
        self.embedding = Embedding(cfg, self.padded_vocab) if pre_process else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in ids})
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layernorm_eps) if post_process else None
        if post_process and not (cfg.tie_embeddings and pre_process):
            # Untied head, or a last pipeline stage that keeps its own copy of the tied
            # table (kept equal to the first stage's by summing their gradients).
            self.head = nn.Parameter(torch.empty(self.padded_vocab, cfg.d_model))
            self.head.vocab_rows = cfg.vocab_size
        else:
            self.head = None

    def output_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.head is None else self.head

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` without labels; per-token fp32 losses ``[b, s]`` with them.

        Non-final pipeline stages take and return hidden states instead.
        """
        x = self.embedding(tokens) if self.pre_process else tokens
        for block in self.blocks.values():
            x = block(x)
        if not self.post_process:
            return x
        logits = F.linear(self.final_norm(x), self.output_weight())[..., : self.cfg.vocab_size]
        if labels is None:
            return logits
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="none")
        return losses.view_as(labels)


def parameter_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter: the same in every process and layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_std(name: str, param: torch.Tensor, cfg: ModelConfig) -> float | None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer); None = constant."""
    if getattr(param, "residual_projection", False):
        return 0.02 / math.sqrt(2 * cfg.n_layer)
    if name.endswith(".bias") or ".ln" in name or name.startswith("final_norm"):
        return None
    return 0.02


@torch.no_grad()
def init_parameters(model: GPT, seed: int) -> None:
    """Draw each parameter whole from its own generator, then copy in the local part.

    Values are drawn in fp32 on the CPU so every dtype and device starts from the same
    numbers; vocabulary padding rows are zero (they never receive a gradient).
    """
    for name, param in model.named_parameters():
        std = _init_std(name, param, model.cfg)
        if std is None:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        rows = getattr(param, "vocab_rows", param.shape[0])
        gen = torch.Generator().manual_seed(parameter_seed(seed, _canonical_name(name)))
        full = torch.empty((rows, *param.shape[1:]), dtype=torch.float32).normal_(0.0, std, generator=gen)
        param.zero_()
        param[:rows].copy_(full)


def _canonical_name(name: str) -> str:
    """A last stage's copy of the tied table starts from the same numbers as the original."""
    return "embedding.word.weight" if name == "head" else name


def count_parameters(cfg: ModelConfig, *, exclude_embeddings: bool = False) -> int:
    """Parameters of the whole (unpadded) model, from its shape alone."""
    d, f, L = cfg.d_model, cfg.ffn_size, cfg.n_layer
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    embed = cfg.vocab_size * d + cfg.seq_len * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = L * per_block + 2 * d + head
    return total if exclude_embeddings else total + embed


def training_flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs per trained token: forward plus backward (3x forward), no recompute.

    Per token and layer the forward pass does 24 d^2 (QKV, projection, 4x MLP matmuls,
    each FLOP counted as 2 for multiply-add) plus 4 s d for the attention scores and the
    weighted sum; the logits add 2 d V. Backward costs twice the forward. This is the
    formula of Narayanan et al. (2021): 72 B s L d^2 (1 + s/(6d)) + 6 B s d V per batch.
    """
    d, s, L, V = cfg.d_model, cfg.seq_len, cfg.n_layer, cfg.vocab_size
    f_ratio = cfg.ffn_size / (4 * d)
    per_layer = 8 * d * d + 16 * d * d * f_ratio + 4 * s * d
    return 3.0 * (L * per_layer + 2 * d * V)


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample continuations of ``prompt`` ([b, t] token ids); returns prompt + new tokens."""
    was_training = model.training
    model.eval()
    ids = prompt
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.cfg.seq_len:])[:, -1, :].float()
        ids = torch.cat([ids, sample_next(logits, temperature, top_k, generator)], dim=1)
    model.train(was_training)
    return ids


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from last-position logits: greedy at temperature 0, else top-k sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)
