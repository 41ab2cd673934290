"""Multi-token prediction (DeepSeek-V3, section 2.2; ``--mtp-layers N``): ``N`` sequential
modules after the main model, on the last pipeline stage, each predicting one token
further ahead; training only (docs/mtp.md).

Depth ``k`` (1..N) at position ``i`` combines the previous depth's hidden state there
(``h_0``: the main model's last hidden state after its final norm, what its head reads,
as transformers', vLLM's and SGLang's DeepSeek-V3 MTP modules take it, so that published
MTP weights load) with the embedding
of token ``i + k``, and predicts token ``i + 1 + k``::

    h_k[i] = block_k(proj_k(concat(enorm_k(E(t[i + k])), hnorm_k(h_{k-1}[i]))))
    loss_k = cross entropy of head(final_norm_k(h_k[i])) against t[i + 1 + k]

The embedding ``E`` and the output head are the main model's tensors. A last pipeline
stage that does not hold the embedding keeps a copy of the table (the tied head when
the embeddings are tied, else ``embedding_copy``), marked ``tied_copy`` and kept equal
to the first stage's by summing the two gradients over the embedding group, as a tied
head is (optim/grads.py).

Parameter names (a Hugging Face mapping relies on them): ``mtp.{k-1}.enorm.weight``,
``mtp.{k-1}.hnorm.weight``, ``mtp.{k-1}.proj.weight`` ``[d, 2d]`` (DeepSeek's eh_proj,
the embedding's half first), ``mtp.{k-1}.block.*`` (a decoder Block with global layer
index ``n_layer + k - 1``: MoE where ``cfg.is_moe_layer`` says so) and
``mtp.{k-1}.final_norm.weight``.

The projection is replicated over tensor parallelism (each rank applies it to the
hidden states it holds: its sequence shard under sequence parallelism, whose weight
gradient is then partial and summed over TP like a norm's).

**The loss.** The main loss is the mean token loss over the global batch: the summed
token losses over ``global_tokens`` (trainer.py). Each depth's summed token loss is
normalised by the same count (Megatron's choice: its last ``k`` positions of every
window have no target and count as zero), so the training loss is::

    main + C x (1 / N) x sum_k (depth k's summed loss / global_tokens)

The MTP term joins backward only (:func:`add_mtp_loss`): the value the model returns,
and so the reported ``loss``, stays the main loss; the MTP loss is accumulated apart
(:func:`take_loss_sum`) and reported as ``mtp_loss``.

**The shifted tokens.** Depth ``k`` reads tokens ``t[i + k]`` (the micro-batch's
``tokens``: labels can be IGNORE_INDEX where tokens are real, e.g. fine-tuning prompts)
and targets ``labels[i + k]``. Under context parallelism a rank holds two chunks of
every sequence (context_parallel.split_sequence), and the shifted ones come from other
chunks: the integers are gathered over cp (once per micro-batch), shifted whole and
split again.
"""

from __future__ import annotations

import torch
from torch import nn

from gridtrain.config import ModelConfig
from gridtrain.models import llama
from gridtrain.parallel.context_parallel import ContextParallel, join_sequence, split_sequence
from gridtrain.parallel.recompute import Recomputation
from gridtrain.parallel.tensor_parallel import IGNORE_INDEX, ShardSpec, TensorParallel, vocab_parallel_embedding
from gridtrain.runtime import activation_meter as memory


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection, a transformer block (built by the
    caller, with the main blocks' parts) and the norm before the shared head."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, block: nn.Module):
        super().__init__()
        self.enorm = llama.rms_norm(cfg, tp)
        self.hnorm = llama.rms_norm(cfg, tp)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.proj.weight.sequence_parallel = tp.sequence_parallel  # a sequence shard's gradient: partial
        self.block = block
        self.final_norm = llama.rms_norm(cfg, tp)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, recompute: Recomputation,
                documents=None) -> torch.Tensor:
        """``h_k`` (before ``final_norm``) from ``E(t[i + k])`` and ``h_{k-1}``; the block
        is recomputed in backward under ``--recompute full``, as the main blocks are."""
        x = self.proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))

        def run(x: torch.Tensor) -> torch.Tensor:  # documents bound in: the rebuild masks as the forward did
            return self.block(x, documents=documents)
        return recompute.checkpoint(run, x) if recompute.full else run(x)


def embedding_copy(cfg: ModelConfig, padded_vocab: int, tp: TensorParallel) -> nn.Parameter:
    """A last stage's copy of the token table (this rank's vocabulary rows), for the MTP
    modules' lookups where the stage holds neither the table nor a tied head copy of it."""
    copy = nn.Parameter(torch.empty(padded_vocab // tp.size, cfg.d_model))
    copy.tp_spec = ShardSpec(0)
    copy.vocab_rows = cfg.vocab_size
    copy.tied_copy = True
    return copy


def shifted(tokens: torch.Tensor, labels: torch.Tensor, depths: int,
            cp: ContextParallel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each depth's (inputs, targets) at this rank's positions: token ``i + k`` (0 past
    the window) and label ``i + k`` (IGNORE_INDEX past it), for ``k`` = 1..``depths``.
    Under context parallelism ``tokens`` and ``labels`` are this rank's chunks; they are
    gathered whole over cp (integers), shifted and split again."""
    both = torch.stack([tokens, labels.to(tokens.dtype)])  # [2, b, s]
    if cp.size > 1:
        both = join_sequence(cp.comm.all_gather_list(both), dim=2)
    # what enters past the window: token 0, label IGNORE_INDEX (made on the device: a
    # host constant copied there would be a blocking copy per micro-batch)
    fill = torch.stack([torch.zeros_like(both[0, :, :1]), torch.full_like(both[1, :, :1], IGNORE_INDEX)])
    streams = []
    for k in range(1, depths + 1):
        moved = torch.cat([both[:, :, k:], fill.expand(2, both.shape[1], k)], dim=2)
        if cp.size > 1:
            moved = split_sequence(moved, cp.size, cp.rank, dim=2)
        streams.append((moved[0], moved[1]))
    return streams


def add_mtp_loss(decoder: nn.Module, loss: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor | None,
                 labels: torch.Tensor, documents=None) -> torch.Tensor:
    """The main summed loss ``loss``, unchanged in value, with ``C / N x`` the depths'
    summed losses joining its backward (the module docstring); their sum is added to
    ``decoder.mtp_loss_sum`` for the report. ``hidden``: ``h_0``, the main model's
    last hidden state after the final norm; ``tokens``, ``labels``: the micro-batch's
    (this cp rank's chunks)."""
    if tokens is None:
        raise ValueError("multi-token prediction embeds later tokens of the micro-batch: the last chunk needs "
                         "its tokens (Decoder.forward's tokens=)")
    depths = len(decoder.mtp)
    weight = decoder.input_weight()
    total, h = None, hidden
    for k, (module, (inputs, targets)) in enumerate(zip(decoder.mtp, shifted(tokens, labels, depths, decoder.cp))):
        with memory.layer_scope(f"mtp.{k}"):
            h = module(vocab_parallel_embedding(inputs, weight, decoder.tp), h, decoder.recompute, documents)
            part = decoder.head_loss(module.final_norm(h), targets, "sum")
        total = part if total is None else total + part
    detached = total.detach().to(torch.float64)
    decoder.mtp_loss_sum = detached if decoder.mtp_loss_sum is None else decoder.mtp_loss_sum + detached
    extra = total * (decoder.cfg.mtp_loss_coeff / depths)
    return loss + (extra - extra.detach())  # + 0 exactly: the value stays the main loss, the gradient gains extra's


def take_loss_sum(model: nn.Module) -> torch.Tensor | None:
    """The MTP loss summed over this rank's micro-batches since the last call, as the
    mean over depths of each depth's summed token loss (divide by the step's
    loss-bearing tokens for ``mtp_loss``); None on a stage or model without MTP."""
    total = getattr(model, "mtp_loss_sum", None)
    if total is None:
        return None
    model.mtp_loss_sum = None
    return total / len(model.mtp)


def layer_ids(cfg: ModelConfig) -> range:
    """The MTP blocks' global layer indices: ``n_layer`` .. ``n_layer + N - 1``."""
    return range(cfg.n_layer, cfg.n_layer + cfg.mtp_layers)

