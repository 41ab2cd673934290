"""The built-in providers that turn ``pretrain`` into ``gridtrain train``: Decoder and text data.

A user's own model and data plug in by writing functions with the same signatures
(see the README's "Python API" section).
"""

from __future__ import annotations

import torch
from torch import nn

from gridtrain.config import Config
from gridtrain.data import Batch, ByteTokenizer, Datasets, load_tokenizer
from gridtrain.data.mixture import MixtureDataset, build_sources
from gridtrain.parallel.distributed import DistributedContext
from gridtrain.models.decoder import Decoder, ChunkSpec, parameter_costs, profile_units
from gridtrain.memory.model import block_partition, chunks_of_stage
from gridtrain.parallel.pipeline.partition import UnitCosts


def decoder_model_provider(cfg: Config, ctx: DistributedContext) -> nn.Module:
    """This rank's chunks of the Decoder of ``cfg.model``, split over TP and PP, built on
    the meta device in the run's dtype: the trainer gives memory and values only to what
    the rank owns (gridtrain.checkpoint.materialise: the same values on every layout)."""
    with torch.device("meta"):
        model = Decoder(cfg.model, tp=ctx.tp, chunks=stage_chunks(cfg, ctx), recompute=ctx.recompute, cp=ctx.cp,
                        ep=ctx.ep, loss_chunks=cfg.activations.loss_chunks)
    return model.to(dtype=ctx.param_dtype)


def stage_chunks(cfg: Config, ctx: DistributedContext) -> list[ChunkSpec]:
    """The model chunks of this rank's pipeline stage (one per virtual stage it holds):
    the memory model's partition (memory.model.chunks_of_stage), so the model built is
    the model counted.

    A measured ("time") partition is computed on rank 0 and broadcast, so that every
    rank cuts the model at the same places.
    """
    measured = cfg.parallel.pp_layers is None and cfg.parallel.pp_partition == "time"
    layers = None
    if measured:
        box = [None]
        if ctx.rank == 0:
            costs = unit_costs(cfg, "time", device=ctx.device, dtype=ctx.param_dtype)
            box[0] = block_partition(cfg, ctx.grid, costs)
        torch.distributed.broadcast_object_list(box, src=0)
        layers = box[0]
    return chunks_of_stage(cfg, ctx.grid, ctx.coords.pp, layers)


def unit_costs(cfg: Config, method: str, *, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> UnitCosts | None:
    """The costs ``--pp-partition`` balances: none (equal block counts), parameter
    counts, or forward+backward times measured by this process on the training device
    and dtype."""
    if method == "parameters":
        return parameter_costs(cfg.model)
    if method == "time":
        return profile_units(cfg.model, cfg.training.micro_batch_size, device=device, dtype=dtype)
    return None


def text_datasets_provider(cfg: Config) -> Datasets:
    """Windows of ``seq_len + 1`` tokens over --data (or the built-in corpus), or packed
    fine-tuning samples; several weighted sources behind one dataset for a mixture, each
    with its own validation set (gridtrain.data.mixture)."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    train, valid = build_sources(cfg.data, tokenizer, cfg.model.seq_len, cfg.training.global_batch_size,
                                 documents=cfg.data.document_mask)
    unit = "nats/byte" if isinstance(tokenizer, ByteTokenizer) else "nats/token"
    one = len(train) == 1
    dataset = train[0].train if one else MixtureDataset([s.train for s in train], [s.name for s in train],
                                                         [s.weight for s in train])
    held = valid[0].valid if one and len(valid) == 1 and cfg.data.valid_data is None else \
        {s.name: s.valid for s in valid}
    return Datasets(train=dataset, valid=held or None, tokenizer=tokenizer,
                    reference_loss=train[0].reference_loss if one else None, loss_unit=unit,
                    every_label_counts=all(s.every_label_counts for s in train),  # windows of a token stream
                    notes=[s.note for s in train + valid if s.note])


def decoder_forward_step(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed token loss of one micro-batch (the loop scales it into the global mean),
    through the Decoder's fused, chunked head + loss (``--loss-chunks``); with
    ``--document-mask`` the batch's ``documents`` mask the attention."""
    if "documents" in batch:
        return model(batch["tokens"], batch["labels"], documents=batch["documents"], reduction="sum")
    return model(batch["tokens"], batch["labels"], reduction="sum")
