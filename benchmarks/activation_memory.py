"""Saved-activation bytes per transformer layer, measured, beside the formula of Korthikanti
et al. adapted to this implementation (gridtrain/memory/activations.py, docs/memory.md).

Counts, not timings: each setup trains one step of the `small` shape with op-by-op
attention (`--attention math`) and dropout, with the saved-tensor meter on, and the
table gives one block's bytes per micro-batch, the formula, their ratio and the stage's
peak of bytes held for backward. The numbers are deterministic; any machine prints the
same table.

    python3 benchmarks/activation_memory.py            # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import argparse

import torch

import common  # benchmarks/common.py: the script's own folder is on sys.path
from gridtrain.config import preset_config, set_fields
from gridtrain.training.validate import validate
from gridtrain.memory.activations import dropout_mask_bytes, korthikanti_bytes
from gridtrain.training.providers import decoder_forward_step, decoder_model_provider, text_datasets_provider
from gridtrain.training.loop import pretrain

SETUPS = [  # (dtype, tp, sequence parallel, recompute)
    *[(dtype, 1, False, mode) for dtype in ("fp32", "bf16") for mode in ("none", "selective", "full")],
    *[("fp32", 2, sp, mode) for sp in (False, True) for mode in ("none", "selective", "full")],
]


def _config(dtype: str, tp: int, sp: bool, mode: str, opts: argparse.Namespace):
    cfg = preset_config("small")
    cfg.model.attention, cfg.model.dropout = "math", opts.dropout
    cfg.parallel.nproc, cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, tp, sp
    set_fields(cfg, dtype=dtype, recompute=mode, steps=1, micro_batch_size=opts.micro_batch_size,
               global_batch_size=2 * opts.micro_batch_size, eval_interval=0, eval_iters=1, progress=False)
    return validate(cfg, world_size=tp)


def _worker(rank: int, world_size: int, cfg) -> object:
    """One step of ``pretrain`` (``gridtrain.training.trainer.build``, then the loop), which measures
    the first step's saved activations; this rank's stage memory."""
    return pretrain(decoder_model_provider, text_datasets_provider, decoder_forward_step, cfg).memory[0]


def _formula(cfg, mode: str, tp: int, sp: bool) -> float:
    m, e = cfg.model, torch.finfo(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[cfg.training.dtype])).bits // 8
    return korthikanti_bytes(seq=m.seq_len, batch=cfg.training.micro_batch_size, hidden=m.d_model, heads=m.n_head,
                             ffn=m.ffn_size, tp=tp, sequence_parallel=sp, recompute=mode, element_bytes=e,
                             mask_bytes=dropout_mask_bytes("cpu", e), dropout=m.dropout > 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_micro_batch_arguments(p)
    p.add_argument("--dropout", type=float, default=0.1)
    opts = p.parse_args()
    shape = preset_config("small").model
    print(f"small shape: s {shape.seq_len}, h {shape.d_model}, a {shape.n_head}, ffn {shape.ffn_size}, "
          f"micro-batch {opts.micro_batch_size}, dropout {opts.dropout}, attention math, CPU "
          f"(dropout masks in the activation dtype), torch {torch.__version__}")
    print("| dtype | tp | SP | recompute | measured per block (KiB) | formula (KiB) | ratio | stage peak (KiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype, tp, sp, mode in SETUPS:
        cfg = _config(dtype, tp, sp, mode, opts)
        stage = common.run_ranks(_worker, tp, cfg)[0]  # one rank: in this process
        measured = stage.per_micro_batch("blocks.0")
        expected = _formula(cfg, mode, tp, sp)
        print(f"| {dtype} | {tp} | {'yes' if sp else 'no'} | {mode} | {measured / 1024:,.1f} | "
              f"{expected / 1024:,.1f} | {measured / expected:.4f} | {stage.peak_bytes / 1024:,.1f} |")


if __name__ == "__main__":
    main()
