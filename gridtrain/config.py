"""Configuration: dataclasses, presets, YAML files and command-line overrides.

Everything a run needs is decided here; :mod:`gridtrain.training.validate` checks it before
any process is spawned or any collective starts. Every value is checked against its
field's type where it enters (YAML file, flags, or :func:`check_types` for configs built
in Python), because a wrong type found later is a traceback inside a worker. This
module imports nothing else of the package, so that every other module may import it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

DTYPES = ("fp32", "bf16", "fp16", "fp64")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION = ("sdpa", "math")  # the attention core
ATTENTION_TYPES = ("mha", "mla")  # the attention layer: multi-head (grouped-query) or multi-head latent
ARCHS = ("gpt2", "llama")
ROPE_SCALINGS = ("llama3", "yarn")
MOE_ROUTERS = ("softmax", "sigmoid")
QK_NORMS = ("head", "full")
DEVICES = ("cpu", "cuda")
BACKENDS = ("nccl", "gloo")
COMPILE_BACKENDS = ("inductor", "aot_eager")  # torch.compile's, for --compile
FP8_RECIPES = ("none", "tensorwise", "rowwise")  # --fp8 (parallel/float8.py)
# one source of a data mixture, ``WEIGHT:PATH`` (gridtrain.data.mixture)
WEIGHTED_SOURCE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*:(.+)$")
LR_SCHEDULES = ("cosine", "linear", "wsd", "constant")  # gridtrain.optim.schedules
LR_DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # the shapes of wsd's decay
OPTIMIZERS = ("adamw", "muon")  # gridtrain.optim
MUON_ADJUST_LR = ("original", "match-rms")  # Muon's per-matrix learning-rate rules (optim/muon.py)
MUON_NS_DTYPES = ("auto", "bf16", "fp32", "fp64")  # where Newton-Schulz runs
STATE_DTYPES = ("fp32", "bf16")  # optimizer moments (--optimizer-state-dtype)


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming problem and fix."""


# ------------------------------------------------------------------- declarations
#
# Each field is declared once, here, with everything the rest of the package needs to
# know about it: its `gridtrain train` flag, the help line, its row in the flag table of
# docs/cli.md, the range or the choices that validation enforces, and the section it
# lived in before the sections were split by topic. The parser (gridtrain.cli.parser),
# the checks (gridtrain.training.validate) and the flag table (:func:`flag_table`) read
# these declarations; adding a field is adding one ``option(...)`` line.

DERIVED = "derived"  # the flag of a field is --its-name unless the declaration says otherwise


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = DERIVED, doc: str | None = None,
           metavar: str | None = None, range: str | None = None, hint: str = "",
           choices: tuple[str, ...] | None = None, was: str | None = None, spell=None) -> Any:
    """A dataclass field with its declaration in ``metadata``.

    ``flag``: the `gridtrain train` flag (default ``--field-name``; None: set in a config
    file only). A bool field's flag is a switch that sets the opposite of its default.
    ``help``: the flag's help line; ``doc``: its meaning in that table (default: ``help``).
    ``range``: ">= x", "> x", "[a, b]", "[a, b)" or "(a, b]", with ``hint`` appended to the message;
    ``choices``: the values a string field may take. ``was``: the section that held the
    field before the split by topic, so that old config files and checkpoints that spell it
    there still load. ``spell(value, where)``: turns another way a config file may write
    the value into the field's type (e.g. a YAML list of data sources into ``--data``'s text).
    """
    meta = dict(flag=flag, help=help, doc=doc or help, metavar=metavar, range=range, hint=hint, choices=choices,
                was=was, spell=spell)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str | None:
    """The field's `gridtrain train` flag, or None when only a config file sets it."""
    flag = f.metadata.get("flag", None)
    return "--" + f.name.replace("_", "-") if flag == DERIVED else flag


@dataclass
class ModelConfig:
    """Shape of a decoder: GPT-2 (pre-LayerNorm, GELU MLP, learned positions, biases) or
    Llama (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases)."""

    n_layer: int = option(2, help="transformer blocks", range=">= 1")
    n_head: int = option(4, help="attention heads", range=">= 1")
    d_model: int = option(64, help="hidden size", range=">= 1")
    seq_len: int = option(64, help="sequence length", range=">= 1")
    vocab_size: int = option(257, help="vocabulary size (before padding)", range=">= 1")
    ffn_hidden: int | None = option(None, help="MLP width (default: 4 d_model for gpt2, 8/3 d_model for llama)",
                                    range=">= 1", metavar="F")
    dropout: float = option(0.0, help="dropout probability", range="[0, 1)", metavar="P")
    attention: str = option("sdpa", choices=ATTENTION, metavar="A",
                            help="mha | mla: the attention layer (sets attention_type); sdpa | math: its core "
                                 "(math: op by op, as the memory formula)",
                            doc="`mha` (default) or `mla` (multi-head latent attention, DeepSeek-V2/V3; llama "
                                "only): the attention layer, which a config file spells `attention_type`; `sdpa` "
                                "(default: torch's fused kernel) or `math` (op by op, what the memory formula "
                                "counts): its core")
    attention_type: str = option("mha", flag=None, choices=ATTENTION_TYPES,
                                 help="the attention layer: `mha` (multi-head, grouped-query for llama) or `mla` "
                                      "(multi-head latent attention; `--attention mla` sets it)")
    vocab_pad_multiple: int = option(64, flag=None, range=">= 1", help="the padded vocabulary is a multiple of "
                                     "this times tp")
    layernorm_eps: float = option(1e-5, flag=None, range="> 0",
                                  help="epsilon of the block norms: LayerNorm (gpt2) or RMSNorm (llama)")
    tie_embeddings: bool = option(True, flag="--untie-embeddings",
                                  help="the output head shares the token embedding's weights (the flag unties them)")
    arch: str = option("gpt2", choices=ARCHS, metavar="A", help="gpt2 | llama (default: the preset's)",
                       doc="`gpt2` or `llama` (default: the preset's)")
    # llama only (docs/llama.md): key/value heads (grouped-query attention; None = n_head),
    # rotary base, Llama 3's rope scaling ("llama3" or None) and its parameters, and the
    # context the model was published for (Hugging Face's max_position_embeddings; None = seq_len)
    n_kv_head: int | None = option(None, range=">= 1", metavar="K",
                                   help="key/value heads (llama: grouped-query attention; default n_head)")
    rope_theta: float = option(10000.0, range="> 0", help="rotary base (llama)")
    rope_scaling: str | None = option(None, flag=None, choices=ROPE_SCALINGS,
                                      help="llama: Llama 3's rope scaling (`llama3`), YaRN (`yarn`, DeepSeek-V3) or "
                                           "null")
    rope_factor: float = option(8.0, flag=None, range="> 0", help="llama3 and yarn rope scaling: factor")
    rope_low_freq_factor: float = option(1.0, flag=None, range="> 0", help="llama3 rope scaling: low-frequency factor")
    rope_high_freq_factor: float = option(4.0, flag=None, range="> 0",
                                          help="llama3 rope scaling: high-frequency factor")
    rope_original_max_positions: int = option(8192, flag=None, range=">= 1",
                                              help="llama3 and yarn rope scaling: the context before scaling")
    rope_beta_fast: float = option(32.0, flag=None, range="> 0", help="yarn rope scaling: beta_fast")
    rope_beta_slow: float = option(1.0, flag=None, range="> 0", help="yarn rope scaling: beta_slow")
    rope_mscale: float = option(1.0, flag=None, range=">= 0", help="yarn rope scaling: mscale")
    rope_mscale_all_dim: float = option(0.0, flag=None, range=">= 0",
                                        help="yarn rope scaling: mscale_all_dim (MLA's softmax scale grows by "
                                             "(0.1 mscale_all_dim ln factor + 1)^2)")
    max_positions: int | None = option(None, flag=None, range=">= 1",
                                       help="the context the model was published for (default: seq_len)")
    attn_head_dim: int | None = option(None, flag="--head-dim", range=">= 1", metavar="N",
                                       help="llama: width of each attention head (default d_model / n_head; "
                                            "Qwen3: 128)")
    qk_norm: str | None = option(None, flag="--qk-norm", choices=QK_NORMS, metavar="head|full",
                                 help="llama: RMSNorm of queries and keys before rotary positions: `head` (per "
                                      "head, Qwen3) or `full` (over all heads, OLMoE); null: none")
    # multi-head latent attention (attention_type "mla", models/mla.py, docs/mla.md): DeepSeek-V2/V3's
    # low-rank query and key/value compressions and the decoupled rotary key shared by every head
    q_lora_rank: int = option(0, range=">= 0", metavar="R",
                              help="MLA: rank of the query compression (0: queries projected directly)")
    kv_lora_rank: int = option(512, range=">= 1", metavar="R", help="MLA: rank of the key/value compression "
                               "(the latent the key/value cache keeps)")
    qk_nope_head_dim: int = option(128, range=">= 1", metavar="D",
                                   help="MLA: per-head query/key width without rotary positions")
    qk_rope_head_dim: int = option(64, range=">= 2", metavar="D",
                                   help="MLA: query/key width with rotary positions (the key's part is shared by "
                                        "all heads)")
    v_head_dim: int = option(128, range=">= 1", metavar="D", help="MLA: per-head value width")
    # multi-token prediction (models/mtp.py): DeepSeek-V3's sequential modules after the last block
    mtp_layers: int = option(0, range=">= 0", metavar="N",
                             help="multi-token prediction depths (DeepSeek-V3's MTP modules; 0: none)",
                             doc="multi-token prediction: N sequential modules on the last pipeline stage, depth "
                                 "k predicting token i+1+k (shared embedding and head, own projection and block)")
    mtp_loss_coeff: float = option(0.1, range=">= 0", metavar="C",
                                   help="weight of the multi-token prediction loss (mean over depths)")
    # mixture of experts (models/moe.py, docs/moe.md): n_experts > 0 turns MoE MLPs on
    n_experts: int = option(0, range=">= 0", metavar="E", help="experts per MoE layer (0: dense MLPs)",
                            doc="experts per MoE layer; 0 (default) keeps dense MLPs")
    moe_top_k: int = option(2, range=">= 1", metavar="K", help="experts each token is routed to")
    moe_ffn_hidden: int | None = option(None, range=">= 1", metavar="H",
                                        help="width of each expert's MLP (default: the dense MLP's)")
    moe_shared_experts: int = option(0, range=">= 0", metavar="S",
                                     help="shared experts every token goes through, besides its routed ones",
                                     doc="shared experts every token goes through besides its routed ones (one "
                                         "MLP S x H wide, split over tp like a dense MLP)")
    moe_every: int = option(1, range=">= 1", metavar="N",
                            help="every Nth layer is MoE (layers 0, N, 2N, ...; 1: every layer)")
    moe_aux_loss_coeff: float = option(0.01, range=">= 0", metavar="C",
                                       help="load-balancing loss coefficient (Switch/GShard, global statistics)",
                                       doc="coefficient of the Switch/GShard load-balancing loss, taken from "
                                           "the routing counts of the whole global micro-batch (0: off)")
    moe_capacity_factor: float | None = option(None, range="> 0", metavar="F",
                                               help="expert capacity, F x tokens x k / experts (default: dropless)",
                                               doc="each expert takes at most F x tokens x k / E tokens of a global "
                                                   "micro-batch, the rest are dropped in token order (default: "
                                                   "none, dropless)")
    moe_norm_topk: bool = option(True, flag="--no-moe-norm-topk",
                                 help="renormalize the top-k routing weights to sum to 1 (Mixtral, Qwen3-MoE); "
                                      "false (the flag): the softmax probabilities as they are (OLMoE)")
    moe_router: str = option("softmax", choices=MOE_ROUTERS, metavar="R",
                             help="softmax | sigmoid: the router's scores (sigmoid: DeepSeek-V3)")
    moe_expert_bias_rate: float = option(0.0, range=">= 0", metavar="G",
                                         help="aux-loss-free balancing: per-expert selection bias += G x sign(mean "
                                              "load - load) after each step (0: off)",
                                         doc="aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to "
                                             "the scores for selection only, moved by G x sign(mean load - load) "
                                             "after each step from the global counts (0: off)")
    moe_groups: int = option(1, range=">= 1", metavar="G",
                             help="group-limited routing: experts in G groups (1: no groups)")
    moe_group_top_k: int | None = option(None, range=">= 1", metavar="K",
                                         help="group-limited routing: each token's experts come from its K best "
                                              "groups (default: all groups)")
    moe_routed_scale: float = option(1.0, range="> 0", metavar="S",
                                     help="routed experts' output scaled by S (DeepSeek-V3: 2.5)")
    moe_seq_aux_loss_coeff: float = option(0.0, range=">= 0", metavar="C",
                                           help="DeepSeek-V3's sequence-wise balance loss coefficient (0: off)")
    moe_dense_layers: int = option(0, range=">= 0", metavar="K",
                                   help="the first K layers keep dense MLPs (first_k_dense_replace)")

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.arch == "llama":  # Meta's rule: two thirds of 4 d, rounded up to a multiple of 256
            return -(-8 * self.d_model // (3 * 256)) * 256
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_head

    @property
    def moe_ffn_size(self) -> int:
        """Width of each expert's MLP."""
        return self.moe_ffn_hidden or self.ffn_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has experts instead of a dense MLP (Megatron's
        ``--moe-layer-freq``: layers 0, N, 2N, ...)."""
        return self.n_experts > 0 and layer >= self.moe_dense_layers and layer % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_moe_layer(i)]

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (models/mla.py)."""
        return self.attention_type == "mla"

    @property
    def qk_head_dim(self) -> int:
        """MLA: a query's (and key's) width per head, its unrotated part then its rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head for llama (default n_head), n_head for GPT-2 and for
        latent attention (each head's keys and values come from the shared latent)."""
        return self.n_head if self.mla else self.n_kv_head or self.n_head

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up so every TP rank owns an equal, aligned slice.

        The padding rows are never looked up and are masked out of the softmax, so
        the padded size may depend on the layout without changing the model.
        """
        multiple = self.vocab_pad_multiple * tp
        return -(-self.vocab_size // multiple) * multiple


CP_COMM_MODES = ("ring", "allgather")
ZERO_STAGES = (0, 1, 2, 3)  # what each data-parallel rank shards (optim/, parallel/fully_sharded.py)  # how attention reaches the other cp ranks (parallel/context_parallel.py)


@dataclass
class ParallelConfig:
    """Sizes of the device grid, how the work is scheduled on it, and how the data-parallel
    ranks share gradients and optimizer state.

    ``zero`` and ``bucket_mb`` live here rather than with the optimizer: both decide what
    the data-parallel axis communicates (all-reduce, or reduce-scatter + gather) and what
    each of its ranks holds, as the grid sizes do; the planner searches them with the
    layout and a checkpoint records them as part of the layout that wrote it.
    """

    nproc: int | None = option(None, range=">= 1", help="start N local worker processes (not under torchrun)",
                               doc="start N local worker processes (forked from a warm server); under `torchrun`, "
                                   "WORLD_SIZE/RANK come from the environment")
    dp: int | None = option(None, range=">= 1", hint="; or leave it out to use world / (tp x cp x pp)",
                            metavar="D", help="data-parallel size (default: world / (tp * cp * pp))",
                            doc="data-parallel size; dp x cp x tp x pp must equal the world size (default: "
                                "world / (tp x cp x pp))")
    tp: int = option(1, range=">= 1", metavar="T", help="tensor-parallel size")
    cp: int = option(1, range=">= 1", metavar="C",
                     help="context-parallel size: each sequence split over C ranks (2C chunks, load-balanced)",
                     doc="context-parallel size: each sequence is cut into 2 x C chunks and cp rank r holds "
                         "chunks r and 2C-1-r; dp x cp x tp x pp must equal the world size")
    cp_comm: str = option("ring", metavar="M", choices=CP_COMM_MODES, help="ring | allgather: how attention reaches the other cp ranks' "
                                                    "keys and values",
                          doc="`ring` (default: key/value blocks passed around the cp ranks, overlapped with "
                              "attention) or `allgather` (keys and values all-gathered, gradients "
                              "reduce-scattered)")
    pp: int = option(1, range=">= 1", metavar="P", help="pipeline-parallel size")
    etp: int = option(1, range=">= 1", metavar="N",
                      help="expert tensor parallelism: each expert's MLP split over N ranks",
                      doc="expert tensor-parallel size: each expert's MLP is split over N ranks (column- then "
                          "row-parallel); the expert grid etp x ep x expert-dp is laid over the tp x cp x dp ranks "
                          "of a pipeline stage independently of the attention grid (MoE parallel folding)")
    ep: int = option(1, range=">= 1", metavar="P",
                     help="expert-parallel size: each MoE layer's experts split over P of the dp x cp ranks",
                     doc="expert-parallel size: each MoE layer's experts are split over groups of P consecutive "
                         "dp x cp ranks (tokens reach them by all-to-all); expert gradients are reduced over the "
                         "strided rest (expert-data-parallel). Divides dp x cp and `--n-experts`")
    vpp: int = option(1, range=">= 1", metavar="V", help="model chunks per pipeline rank (interleaved schedule)")
    schedule: str = option("1f1b", metavar="S", help="gpipe | 1f1b | interleaved-1f1b | zb-h1",
                           doc="`gpipe`, `1f1b` (default), `interleaved-1f1b` (needs micro-batches a multiple "
                               "of pp), `zb-h1`")
    sequence_parallel: bool = option(False, help="with --tp > 1: LayerNorm and dropout on sequence shards",
                                     doc="with `--tp` > 1: LayerNorm and dropout on sequence shards (all-gather / "
                                         "reduce-scatter instead of all-reduce)")
    pp_layers: list[int] | None = option(None, metavar="3,4,4,3", help="blocks per virtual stage, e.g. 3,4,4,3",
                                         doc="blocks per virtual stage (pp x vpp entries; the embedding opens the "
                                             "first, the head closes the last)")
    pp_partition: str = option("uniform", metavar="M", help="uniform | parameters | time",
                               doc="`uniform` (default), `parameters` or `time` (profiles each unit first) when "
                                   "`--pp-layers` is not given")
    zero: int = option(0, was="training", metavar="Z", choices=ZERO_STAGES,
                       help="0-3: ZeRO stage over data parallel (1 optimizer state, 2 + gradients, 3 + parameters)",
                       doc="ZeRO stage over the data-parallel (x cp) ranks: `0` replicate everything, `1` shard "
                           "master weights and Adam state, `2` also gradients, `3` also parameters (gathered per "
                           "block, as FSDP)")
    zero_shard_size: int | None = option(None, range=">= 1", metavar="N",
                                         help="shard ZeRO state within groups of N data-parallel ranks, replicate "
                                              "across groups (hybrid sharding)",
                                         doc="hybrid sharding (HSDP): ZeRO state sharded within groups of N "
                                             "consecutive data-parallel (x cp) ranks (a node) and replicated across "
                                             "groups; gradients reduce-scattered in the group, all-reduced across "
                                             "(default: the whole group)")
    zero3_keep_gathered: bool = option(False, help="--zero 3: keep a stage's parameters gathered from forward to "
                                                   "backward within a step",
                                       doc="with `--zero 3`: a stage's parameters stay gathered from their first "
                                           "forward to their last backward of a step (one gather per step instead "
                                           "of two per micro-batch; FSDP2's `reshard_after_forward=False`)")
    bucket_mb: float = option(25.0, range="> 0",
                              help="gradient bucket size in MiB (all-reduce; ZeRO-1: reduce-scatter and parameter "
                                   "gather)",
                              doc="gradient bucket size: all-reduce, or under ZeRO-1 reduce-scatter and parameter "
                                  "gather (default 25, as DDP)")


@dataclass
class TrainingConfig:
    """The run: how long, how large a batch, in which precision, on which device."""

    steps: int = option(100, range=">= 1", help="optimizer steps")
    micro_batch_size: int = option(4, range=">= 1", metavar="M", help="sequences per micro-batch")
    global_batch_size: int = option(8, range=">= 1", metavar="G", help="sequences per optimizer step",
                                    doc="sequences per optimizer step; a multiple of micro-batch size x dp")
    seed: int = option(1234, range=">= 0", metavar="S", help="seed for init, data order and dropout")
    dtype: str = option("fp32", choices=DTYPES, metavar="T", help="fp32 | bf16 | fp16 | fp64",
                        doc="`fp32`, `bf16`, `fp16`, `fp64` (16-bit: fp32 master weights; fp16 adds "
                            "`--loss-scale`)")
    loss_scale: float = option(2.0 ** 16, range="> 0", help="fp16: initial dynamic loss scale")
    loss_scale_window: int = option(1000, flag=None, range=">= 1",
                                    help="fp16: good steps before the loss scale doubles")
    min_loss_scale: float = option(1.0, range="> 0", help="fp16: overflowing at this loss scale stops the run (exit 3)",
                                   doc="fp16: gradients that still overflow at this dynamic loss scale stop the "
                                       "run (default 1)")
    device: str | None = option(None, choices=DEVICES, metavar="cpu|cuda",
                                help="cpu | cuda (default: cuda when available)",
                                doc="default: cuda when available, else cpu (gloo on cpu, nccl on cuda); on cuda "
                                    "(given or the default) each worker needs a GPU of its own: `--nproc N` (or "
                                    "torchrun `--nproc-per-node N`) with fewer GPUs is refused before start, in "
                                    "one line; a worker that sees one GPU (Slurm `--gpus-per-task=1`, one "
                                    "container per GPU) takes it, whatever its LOCAL_RANK")
    backend: str | None = option(None, choices=BACKENDS, metavar="nccl|gloo",
                                 help="collective backend (default: nccl on cuda, gloo on cpu)",
                                 doc="default: nccl on cuda, gloo on cpu. `--backend gloo --device cuda` lets "
                                     "several ranks share one GPU (gloo stages point-to-point transfers through "
                                     "host memory): slow, for checking multi-rank device code on one GPU "
                                     "(`make gpu-check` does)")
    compile: bool = option(False, help="torch.compile each transformer block (forward and backward; the first step "
                                       "compiles)",
                           doc="`torch.compile` each transformer block (forward and its backward; the embedding, "
                               "head, pipeline, hooks and optimizer stay eager); the first step compiles (tens of "
                               "seconds on CPU). Trains the eager model (fp64 1e-9, tested on DP + ZeRO-1 + full "
                               "recomputation, TP + SP, ZB-H1); not with `--recompute selective` or `--dry-run` yet "
                               "(refused)")
    compile_backend: str = option("inductor", choices=COMPILE_BACKENDS, metavar="inductor|aot_eager",
                                  help="torch.compile backend for --compile (default: inductor)",
                                  doc="the `torch.compile` backend of `--compile`: `inductor` (default: fused "
                                      "kernels) or `aot_eager` (the same graph capture and AOTAutograd "
                                      "backward with eager kernels: compiles in a fraction of the time, for "
                                      "checking that a layout composes with compilation, or for telling a "
                                      "kernel's numerics from the capture's)")
    fp8: str = option("none", choices=FP8_RECIPES, metavar="none|tensorwise|rowwise",
                      help="float8 GEMMs in the blocks' linear layers (needs --dtype bf16 and torchao)",
                      doc="the blocks' linear layers (attention projections, MLPs, experts; not the embedding, "
                          "head or router) run their GEMMs in float8 with dynamic scales: `tensorwise` (one "
                          "scale per tensor; e4m3 forward, e5m2 gradients) or `rowwise` (a power-of-two scale "
                          "per row of each operand, e4m3 throughout). Every layout quantises with the scales "
                          "one process would compute (docs/fp8.md). Needs `--dtype bf16` and torchao "
                          "(`pip install gridtrain[fp8]`); on CPU the float8 GEMMs are emulated (exact "
                          "dequantised products), for checking numerics, not speed")
    fp8_all_gather: bool = option(False, help="--zero 3: gather the float8 weights as float8 (half the bytes)",
                                  doc="with `--fp8` and `--zero 3`: each weight shard is cast to float8 with "
                                      "the weight's global scale before its all-gather (half the bytes of "
                                      "bf16); the master weights and checkpoints stay as they are")
    dist_timeout_s: float = option(300.0, flag="--timeout", range="> 0", metavar="S",
                                   help="collective timeout in seconds",
                                   doc="seconds any rank may wait in one collective or point-to-point transfer "
                                       "before the watchdog stops the job with a hang report (default 300)")

    def __getattr__(self, name: str) -> Any:
        """A field that moved out of this section names its new home (``cfg.optim.lr``)."""
        home = MOVED.get(("training", name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}"
                             + (f"; it is cfg.{home}.{name} now" if home else ""))

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting a moved field here would be silently ignored: refused, naming its home."""
        home = None if name in self.__dataclass_fields__ else MOVED.get(("training", name))
        if home is not None:
            raise AttributeError(f"training.{name} is cfg.{home}.{name} now; set it there")
        object.__setattr__(self, name, value)


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon for the hidden matrices with AdamW for the rest) and
    its learning-rate schedule: linear warm-up, then cosine (default), linear,
    warmup-stable-decay or constant (gridtrain.optim.schedules)."""

    optimizer: str = option("adamw", choices=OPTIMIZERS, metavar="O",
                            help="adamw | muon (Muon for the blocks' 2-D weights, AdamW for the rest)",
                            doc="`adamw` (default) or `muon`: Muon (momentum orthogonalised by Newton-Schulz, "
                                "each one-process matrix whole) for the blocks' 2-D weights (attention, MLP, "
                                "experts), AdamW at `--lr` for embeddings, head, norms, biases and routers "
                                "([optimizers](optimizers.md))")
    muon_lr: float | None = option(None, range="> 0", metavar="X",
                                   help="Muon's peak learning rate (default: --lr under match-rms, "
                                        "0.2 x sqrt(d_model) x --lr under original)",
                                   doc="Muon's peak learning rate, on the same schedule as `--lr` (default: `--lr` "
                                       "with `--muon-adjust-lr match-rms`; 0.2 x sqrt(d_model) x `--lr` with "
                                       "`original`, the rate at which a d x d matrix's update has the RMS that "
                                       "match-rms gives it at `--lr`)")
    muon_momentum: float = option(0.95, range="[0, 1)", metavar="M", help="Muon's momentum (default 0.95)")
    muon_nesterov: bool = option(True, flag="--no-muon-nesterov",
                                 help="Muon without Nesterov momentum (default: Nesterov, as torch.optim.Muon)")
    muon_ns_steps: int = option(5, range="[1, 99]", metavar="N", help="Newton-Schulz iterations (default 5)")
    muon_adjust_lr: str = option("original", choices=MUON_ADJUST_LR, metavar="R",
                                 help="original | match-rms: Muon's learning rate per matrix shape",
                                 doc="`original` (default: lr x sqrt(max(1, rows / cols)), torch's default) or "
                                     "`match-rms` (lr x 0.2 x sqrt(max(rows, cols)): the update's RMS matches "
                                     "AdamW's, so Muon takes AdamW's learning rate and weight decay; Moonlight)")
    qk_clip: float = option(0.0, range=">= 0", metavar="TAU",
                            help="QK-clip: rescale a head's query and key weights after the step when its largest "
                                 "attention logit exceeded TAU (0: off)",
                            doc="QK-clip (Kimi K2's MuonClip; with either optimizer): after each step, a head whose "
                                "largest attention logit of the step (over the global batch) exceeded TAU has its "
                                "query and key weights scaled so that it would reach TAU; 0 (default) is off. Not "
                                "with `--qk-norm` ([optimizers](optimizers.md#qk-clip))")
    optimizer_state_dtype: str = option("fp32", choices=STATE_DTYPES, metavar="T",
                                        help="fp32 | bf16: AdamW's moments and Muon's momentum (masters stay fp32)",
                                        doc="`fp32` (default) or `bf16`: AdamW's two moments and Muon's momentum "
                                            "kept in bf16 (updated in the masters' precision, rounded when "
                                            "stored); master weights stay fp32 (fp64 in fp64 runs)")
    optimizer_offload: bool = option(False, help="keep the optimizer's state in host memory and step it there "
                                                 "(GPU runs; on cpu it is there already)",
                                     doc="the flat optimizer's master weights and moments in host memory and its "
                                         "step on the host: each step copies the gradient shard out and the "
                                         "updated weights back (a GPU then holds no optimizer state); on `cpu` "
                                         "the state is in host memory already and nothing changes (the run says so)")
    muon_ns_dtype: str = option("auto", choices=MUON_NS_DTYPES, metavar="T",
                                help="auto | bf16 | fp32 | fp64: the dtype of the Newton-Schulz iterations "
                                     "(auto: fp64 in fp64 runs, else bf16 on GPUs as torch.optim.Muon, fp32 on "
                                     "CPUs)")

    lr: float = option(1e-3, range="> 0", was="training", help="peak learning rate")
    lr_schedule: str = option("cosine", choices=LR_SCHEDULES, metavar="S",
                              help="cosine | linear | wsd | constant (after the warm-up)",
                              doc="after the linear warm-up: `cosine` (default) or `linear` decay to the floor "
                                  "(`--min-lr-ratio`) over the rest of the run, `wsd` (warmup-stable-decay: lr, "
                                  "then decay over the last `--lr-decay-fraction` of the steps), `constant`")
    lr_decay_fraction: float | None = option(None, range="(0, 1]", metavar="F",
                                             help="wsd: decay over the last F of the steps (default 0.2)")
    lr_decay_shape: str | None = option(None, choices=LR_DECAY_SHAPES, metavar="D",
                                        help="wsd: the decay's shape, linear | cosine | 1-sqrt (default 1-sqrt)",
                                        doc="wsd: the decay's shape, `linear`, `cosine` or `1-sqrt` (default; "
                                            "lr falls as 1 - sqrt(progress))")
    min_lr_ratio: float = option(0.1, range="[0, 1]", was="training", metavar="R",
                                 help="the decay ends at lr times this (default 0.1)")
    warmup_steps: int | None = option(None, range=">= 0", was="training",
                                      help="linear warm-up steps (default 5% of steps)")
    weight_decay: float = option(0.1, range=">= 0", was="training",
                                 help="decoupled weight decay of matrices and embeddings (AdamW and Muon)")
    beta1: float = option(0.9, flag=None, range="[0, 1)", was="training", help="AdamW's first-moment decay")
    beta2: float = option(0.95, flag=None, range="[0, 1)", was="training", help="AdamW's second-moment decay")
    adam_eps: float = option(1e-8, flag=None, range="> 0", was="training", help="AdamW's epsilon")
    grad_clip: float = option(1.0, range=">= 0", hint=" (0 turns clipping off)", was="training",
                              help="global gradient-norm clip (0: off)")

    def warmup(self, steps: int) -> int:
        """Warm-up steps of a run of ``steps``: warmup_steps, else 5% of them (at least 1)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, steps // 20)


@dataclass
class ActivationsConfig:
    """What the forward pass keeps for backward, and where (docs/memory.md)."""

    recompute: str = option("none", choices=RECOMPUTE, was="training", metavar="R",
                            help="none | selective | full",
                            doc="`none`, `selective` (recompute the attention core), `full` (recompute whole "
                                "blocks)")
    recompute_method: str = option("uniform", choices=RECOMPUTE_METHODS, was="training", metavar="M",
                                   help="uniform | block (full: groups of N blocks | the first N blocks of each "
                                        "chunk)",
                                   doc="with `full`: `uniform` (default; groups of N blocks, each group keeps only "
                                       "its input) or `block` (the first N blocks of each model chunk, the rest "
                                       "keep everything)")
    recompute_layers: int = option(1, range=">= 1", was="training",
                                   help="the N of --recompute-method (default 1)")
    recompute_keep_last: bool = option(False, was="training",
                                       help="the last micro-batch of a step keeps its activations (GPipe)",
                                       doc="the last micro-batch of each step keeps its activations (GPipe: its "
                                           "backward comes next)")
    recompute_early: bool = option(False, was="training",
                                   help="with --pp > 1: recompute while the output gradient is on its way",
                                   doc="with `--pp` > 1: rebuild a micro-batch's activations right after posting "
                                       "the receive of its gradient, overlapping the wait")
    loss_chunks: int | None = option(None, range=">= 0", metavar="N",
                                     help="the LM head and loss fused over N chunks of each micro-batch (default: "
                                          "automatic; 0: unfused, the whole micro-batch's logits)",
                                     doc="the LM head and cross entropy fused and run over N chunks of each "
                                         "micro-batch's tokens, so its logits never exist at once (forward and "
                                         "backward; with TP too). Default: automatic (fused, in chunks of at most "
                                         "32 MiB of fp32 logits, where a micro-batch's logits exceed that; the "
                                         "unfused head below it, and under `--compile` without TP); 0: the "
                                         "unfused head and torch's cross entropy (the micro-batch's fp32 logits "
                                         "kept for backward)")
    offload_activations: bool = option(False, was="training",
                                       help="keep saved activations in host memory until backward (GPU)",
                                       doc="on a GPU, keep saved activations in pinned host memory until backward; "
                                           "on CPU a no-op (says so)")


@dataclass
class CheckpointConfig:
    """Where checkpoints go, how often, and what a run starts from."""

    save: str | None = option(None, was="training", metavar="DIR", help="checkpoint directory")
    save_interval: int = option(0, range=">= 0", hint=" (0 saves at the end only)", was="training", metavar="K",
                                help="steps between checkpoints (0: at end)")
    keep_last: int = option(0, range=">= 0", hint=" (0 keeps every checkpoint)", was="training", metavar="K",
                            help="keep only the newest K checkpoints in --save (0: all)")
    save_async: bool = option(False, was="training",
                              help="write checkpoints in the background: training waits only while the state is "
                                   "copied to host memory",
                              doc="write checkpoints in the background: the step waits only while this rank's "
                                  "state is copied to host memory; the run summary reports the blocking time "
                                  "per save")
    load: str | None = option(None, was="training", metavar="DIR", help="resume from this checkpoint directory")
    init_from: str | None = option(None, was="training", metavar="PATH",
                                   help="start from these weights (a checkpoint or a Hugging Face directory; step "
                                        "0, fresh optimizer)",
                                   doc="start from the weights of a gridtrain checkpoint or a Hugging Face "
                                       "directory: step 0, a fresh optimizer, any layout (fine-tuning); the "
                                       "model's shape and tokenizer come from the source (see "
                                       "[Hugging Face](models.md#hugging-face))")
    auto_resume: bool = option(False, was="training",
                               help="resume from the --save directory's latest checkpoint when there is one, else "
                                    "start fresh (the same command restarts a preempted job)")
    reset_optimizer: bool = option(False, help="with --load: the weights, step and data position from the "
                                               "checkpoint, the optimizer's state from zero",
                                   doc="with `--load` (or `--auto-resume`): take the weights, the step and the data "
                                       "position, start the optimizer's state (moments, step count) afresh; needed "
                                       "to resume with another `--optimizer` than the checkpoint's")


@dataclass
class EvalConfig:
    """Validation passes on the held-out windows."""

    eval_interval: int = option(50, range=">= 0", hint=" (0 turns validation off)", was="training", metavar="K",
                                help="steps between validation passes")
    eval_iters: int = option(4, range=">= 1", hint="; use --eval-interval 0 to turn validation off", was="training",
                             help="global batches per validation pass")


@dataclass
class SampleConfig:
    """The text sampled from the model at the end of a run."""

    sample_tokens: int = option(0, range=">= 0", hint=" (0: no sample)", was="training",
                                help="print a sample this long after training")
    prompt: str = option("", was="training", metavar="TEXT", help="prompt for the closing sample")
    temperature: float = option(0.8, flag=None, range="> 0", was="training", help="sampling temperature")
    top_k: int | None = option(40, flag=None, range=">= 1", hint="; or null for no top-k cut", was="training",
                               help="sample among the K likeliest tokens (null: all)")


@dataclass
class MetricsConfig:
    """What the run reports besides its log: metrics, traces, memory, progress."""

    metrics_file: str | None = option(None, was="training", metavar="F", help="JSON lines, one per optimizer step",
                                      doc="JSON lines, one per optimizer step (below)")
    tensorboard: str | None = option(None, was="training", metavar="DIR",
                                     help="write per-step metrics as TensorBoard events here",
                                     doc="also write each step's metrics as TensorBoard events (`tensorboard "
                                         "--logdir DIR`); needs the `tensorboard` extra")
    trace: str | None = option(None, was="training", metavar="DIR",
                               help="write a Chrome trace of pipeline actions per rank here",
                               doc="write `DIR/rankNNN.json`, a Chrome trace of the pipeline actions each rank ran")
    memory_report: bool = option(False, was="training",
                                 help="print saved-activation bytes per layer and stage, beside the formula",
                                 doc="print bytes saved for backward per stage and layer (measured at step 1) "
                                     "beside the formula")
    peak_tflops: float | None = option(None, range="> 0", was="training", help="device peak for MFU",
                                       doc="device peak for MFU where it is not known (CPUs)")
    progress: bool = option(True, flag="--no-progress", was="training", help="no progress bar")


def spell_sources(value: Any, where: str) -> Any:
    """A YAML list of data sources (``["0.7:web.bin", ...]`` or ``[{path: web.bin,
    weight: 0.7}, ...]``) as the one text ``--data`` takes; anything else as it is."""
    if not isinstance(value, list):
        return value
    pieces = []
    for entry in value:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            pieces.append(f"{entry.get('weight', 1)}:{entry['path']}")
        elif isinstance(entry, str):
            pieces.append(entry if WEIGHTED_SOURCE.match(entry) else f"1:{entry}")
        else:
            raise ConfigError(f"{where}: source {entry!r} is neither 'WEIGHT:PATH' nor {{path: PATH, weight: W}}; "
                              "write each source one of those ways")
    if not pieces:
        raise ConfigError(f"{where}: the list of sources is empty; name at least one")
    return ",".join(pieces)


@dataclass
class DataConfig:
    """Where tokens come from: None means the built-in corpus (Python's stdlib sources)."""

    path: str | None = option(None, flag="--data", metavar="PATH", spell=spell_sources,
                              help="text file, folder of text, JSON lines or token file, or a mixture "
                                   "W:PATH,W:PATH,... (default: built-in corpus)",
                              doc="a text file, a folder of text files, JSON lines (`.jsonl`: one "
                                  "`{\"text\": ...}` document per line, or fine-tuning records: see "
                                  "[Training data](data.md#training-data)), or a token file from `gridtrain "
                                  "prepare`; or a mixture `W:PATH,W:PATH,...` (in a config file also a YAML "
                                  "list); default: built-in corpus")
    valid_data: str | None = option(None, metavar="PATH", spell=spell_sources,
                                    help="validation sources (PATH or PATH,PATH,...): evaluated whole, and the "
                                         "--data sources are not split",
                                    doc="validation sources, `PATH` or `PATH,PATH,...` (any kind `--data` "
                                        "takes): each is evaluated and reported on its own, and the `--data` "
                                        "sources then keep every sample for training (default: every "
                                        "`valid_every`-th sample of each `--data` source is held out)")
    tokenizer: str | None = option(None, metavar="FILE", help="Hugging Face tokenizer.json (default: bytes)",
                                   doc="a Hugging Face `tokenizer.json`; default: bytes (vocabulary 257 with an "
                                       "end-of-text token)")
    valid_every: int = option(100, flag=None, range=">= 2", hint=" (every Nth window is held out for validation)",
                              help="every Nth window of the corpus is held out for validation")
    document_mask: bool = option(False, help="attention stays within each document of a packed sequence; "
                                             "positions restart at 0 at each document",
                                 doc="attention never crosses a document boundary inside a packed sequence, and "
                                     "positions (learned or rotary) restart at 0 at each document: each document "
                                     "trains as if alone (see [Document masking](data.md#document-masking))")


@dataclass
class Config:
    """A run's whole configuration, one section per topic.

    Before the sections were split by topic, ``training`` held the optimizer, recomputation,
    checkpoint, validation, sampling and metrics fields, and ``zero`` too. Old config files
    and checkpoints that spell a field there still load (see ``was`` in :func:`option`); Python
    code that reads or sets ``cfg.training.lr`` gets an error naming ``cfg.optim.lr``.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    preset: str = "tiny"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        """The config a checkpoint's meta.json holds, in this layout or the one before the
        split by topic."""
        cfg = cls(preset=_preset_name(raw.get("preset", "tiny"), ""))
        for section in SECTIONS:
            _update_section(cfg, section, raw.get(section))
        unknown = set(raw) - {*SECTIONS, "preset"}
        if unknown:
            raise ConfigError(f"unknown config section(s) {sorted(map(str, unknown))}; use {', '.join(SECTIONS)}")
        return cfg


SECTION_CLASSES: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)
                                     if f.name != "preset"}
SECTIONS = tuple(SECTION_CLASSES)


def declared_fields() -> list[tuple[str, dataclasses.Field]]:
    """Every field of every section, in declaration order, with its section's name."""
    return [(section, f) for section, cls in SECTION_CLASSES.items() for f in dataclasses.fields(cls)]


def section_of(name: str) -> str:
    """The section that declares field ``name`` (field names are unique across sections)."""
    for section, f in declared_fields():
        if f.name == name:
            return section
    raise AttributeError(f"no config section has a field {name!r}")


def set_fields(cfg: "Config", **values: Any) -> "Config":
    """Set fields by name wherever they live (``set_fields(cfg, lr=1e-3, recompute="full")``)."""
    for name, value in values.items():
        setattr(getattr(cfg, section_of(name)), name, value)
    return cfg


# (old section, field) -> the section the field lives in now
MOVED: dict[tuple[str, str], str] = {(f.metadata["was"], f.name): section for section, f in declared_fields()
                                     if f.metadata.get("was")}



# Model shapes. `tiny` is for tests, `small` is what `make train` trains in a few minutes
# on two CPU cores, the gpt2* entries are the Hugging Face GPT-2 shapes. The Llama
# entries are the published shapes (Hugging Face config.json: vocab_size, hidden_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
# rope_theta, rms_norm_eps, tie_word_embeddings, max_position_embeddings, rope_scaling);
# their seq_len is the context they were pre-trained at, and `llama-tiny` is for tests.
_LLAMA = dict(arch="llama", tie_embeddings=False, layernorm_eps=1e-5)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, n_kv_head=8, rope_theta=500000.0, seq_len=8192, max_positions=8192)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_head=4, d_model=64, seq_len=64, vocab_size=257),
    "small": dict(n_layer=4, n_head=4, d_model=128, seq_len=128, vocab_size=257),
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50257),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024, vocab_size=50257),
    "gpt2-large": dict(n_layer=36, n_head=20, d_model=1280, seq_len=1024, vocab_size=50257),
    "gpt2-xl": dict(n_layer=48, n_head=25, d_model=1600, seq_len=1024, vocab_size=50257),
    "llama-tiny": dict(_LLAMA, n_layer=2, n_head=8, n_kv_head=2, d_model=64, ffn_hidden=160, seq_len=64,
                       vocab_size=257),
    "smollm2-135m": dict(_LLAMA, n_layer=30, n_head=9, n_kv_head=3, d_model=576, ffn_hidden=1536,
                         vocab_size=49152, rope_theta=100000.0, tie_embeddings=True, seq_len=2048,
                         max_positions=8192),
    "tinyllama-1.1b": dict(_LLAMA, n_layer=22, n_head=32, n_kv_head=4, d_model=2048, ffn_hidden=5632,
                           vocab_size=32000, seq_len=2048, max_positions=2048),
    "llama2-7b": dict(_LLAMA, n_layer=32, n_head=32, n_kv_head=32, d_model=4096, ffn_hidden=11008,
                      vocab_size=32000, seq_len=4096, max_positions=4096),
    "llama3-8b": dict(_LLAMA3, n_layer=32, n_head=32, d_model=4096, ffn_hidden=14336),
    "llama3-70b": dict(_LLAMA3, n_layer=80, n_head=64, d_model=8192, ffn_hidden=28672),
    # mixtures of experts (docs/moe.md): Hugging Face config.json's num_local_experts / num_experts,
    # num_experts_per_tok, moe_intermediate_size (Mixtral, OLMoE: intermediate_size), norm_topk_prob,
    # router_aux_loss_coef, head_dim and the query/key norms; seq_len is the context trained at
    "moe-tiny": dict(_LLAMA, n_layer=2, n_head=8, n_kv_head=2, d_model=64, ffn_hidden=160, seq_len=64,
                     vocab_size=257, n_experts=8, moe_top_k=2, moe_ffn_hidden=32),
    # Mixtral 8x7B (v0.1): pre-trained at its 32K context (Jiang et al., 2024)
    "mixtral-8x7b": dict(_LLAMA, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336,
                         vocab_size=32000, rope_theta=1000000.0, seq_len=32768, max_positions=32768,
                         n_experts=8, moe_top_k=2, moe_aux_loss_coeff=0.02),
    # Qwen3-30B-A3B: 128-wide heads beside a 2048-wide model, per-head q/k RMSNorm; the 32K stage
    # of its pre-training aside, it trained at 4K (the dense intermediate_size is unused: every
    # layer is MoE)
    "qwen3-30b-a3b": dict(_LLAMA, n_layer=48, n_head=32, n_kv_head=4, d_model=2048, attn_head_dim=128,
                          ffn_hidden=6144, vocab_size=151936, rope_theta=1000000.0, layernorm_eps=1e-6,
                          seq_len=4096, max_positions=40960, n_experts=128, moe_top_k=8, moe_ffn_hidden=768,
                          moe_norm_topk=True, qk_norm="head", moe_aux_loss_coeff=0.001),
    # OLMoE-1B-7B (0924): q/k RMSNorm over the whole projections, top-8 weights not renormalised
    "olmoe-1b-7b": dict(_LLAMA, n_layer=16, n_head=16, n_kv_head=16, d_model=2048, ffn_hidden=1024,
                        vocab_size=50304, rope_theta=10000.0, seq_len=4096, max_positions=4096, n_experts=64,
                        moe_top_k=8, moe_norm_topk=False, qk_norm="full", moe_aux_loss_coeff=0.01),
    # Llama 3.1: the 128K context by Llama 3's rope scaling of the 8K one
    "llama3-405b": dict(_LLAMA3, n_layer=126, n_head=128, d_model=16384, ffn_hidden=53248, max_positions=131072,
                        rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_max_positions=8192),
    # DeepSeek-V3 class (docs/moe.md, docs/hf.md): multi-head latent attention, sigmoid routers with a
    # selection bias, group-limited routing, shared experts, dense first layers, multi-token prediction.
    # Hugging Face config.json keys: q_lora_rank (null: 0), kv_lora_rank, qk_nope_head_dim,
    # qk_rope_head_dim, v_head_dim, n_routed_experts, num_experts_per_tok, moe_intermediate_size,
    # intermediate_size (the dense layers), n_shared_experts, norm_topk_prob, scoring_func, n_group,
    # topk_group, routed_scaling_factor, first_k_dense_replace, num_nextn_predict_layers, rope_scaling
    # (yarn: factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim).
    # seq_len is the context pre-trained at (before the YaRN extension to max_positions). DeepSeek-V3's
    # training choices (Liu et al., 2024, sec. 4.2): bias update speed 0.001, sequence-wise balance
    # loss 0.0001, no Switch loss, MTP depth 1.
    # `deepseek-tiny` has every feature, for tests.
    "deepseek-tiny": dict(_LLAMA, attention_type="mla", n_layer=2, n_head=4, d_model=64, seq_len=64, vocab_size=257,
                          layernorm_eps=1e-6, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16, rope_scaling="yarn", rope_factor=4.0,
                          rope_original_max_positions=16, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0,
                          rope_mscale_all_dim=1.0, max_positions=64, ffn_hidden=160, n_experts=8, moe_top_k=2,
                          moe_ffn_hidden=32, moe_shared_experts=1, moe_router="sigmoid", moe_groups=4,
                          moe_group_top_k=2, moe_routed_scale=2.5, moe_dense_layers=1, moe_expert_bias_rate=0.001,
                          moe_seq_aux_loss_coeff=0.0001, moe_aux_loss_coeff=0.0, mtp_layers=1),
    # deepseek-ai/DeepSeek-V3 (and -V3-Base, R1, V3-0324: the same config.json but for their
    # checkpoints): 671B parameters (MTP module aside), 37B active
    "deepseek-v3": dict(_LLAMA, attention_type="mla", n_layer=61, n_head=128, d_model=7168, vocab_size=129280,
                        layernorm_eps=1e-6, seq_len=4096, max_positions=163840, rope_theta=10000.0,
                        rope_scaling="yarn", rope_factor=40.0, rope_original_max_positions=4096,
                        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, ffn_hidden=18432, n_experts=256, moe_top_k=8, moe_ffn_hidden=2048,
                        moe_shared_experts=1, moe_norm_topk=True, moe_router="sigmoid", moe_groups=8,
                        moe_group_top_k=4, moe_routed_scale=2.5, moe_dense_layers=3, moe_expert_bias_rate=0.001,
                        moe_seq_aux_loss_coeff=0.0001, moe_aux_loss_coeff=0.0, mtp_layers=1),
    # deepseek-ai/DeepSeek-V2-Lite: 15.7B parameters, 2.4B active; softmax router (top-6 of 64 not
    # renormalised, no groups), no query compression, 2 shared experts; its config.json says
    # aux_loss_alpha 0.001 with seq_aux (the sequence-wise balance loss) and YaRN from 4K to 160K
    "deepseek-v2-lite": dict(_LLAMA, attention_type="mla", n_layer=27, n_head=16, d_model=2048, vocab_size=102400,
                             layernorm_eps=1e-6, seq_len=4096, max_positions=163840, rope_theta=10000.0,
                             rope_scaling="yarn", rope_factor=40.0, rope_original_max_positions=4096,
                             rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=0.707, rope_mscale_all_dim=0.707,
                             q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, ffn_hidden=10944, n_experts=64, moe_top_k=6, moe_ffn_hidden=1408,
                             moe_shared_experts=2, moe_norm_topk=False, moe_router="softmax", moe_routed_scale=1.0,
                             moe_dense_layers=1, moe_seq_aux_loss_coeff=0.001, moe_aux_loss_coeff=0.0),
    # moonshotai/Moonlight-16B-A3B: DeepSeek-V3's architecture at 16B (3B active), no query
    # compression, no groups, no rope scaling (8K context), no MTP module. Its config.json says
    # aux_loss_alpha 0.001 with seq_aux; the bias update speed is not published (DeepSeek-V3's here)
    "moonlight-16b-a3b": dict(_LLAMA, attention_type="mla", n_layer=27, n_head=16, d_model=2048, vocab_size=163840,
                              layernorm_eps=1e-5, seq_len=8192, max_positions=8192, rope_theta=50000.0,
                              q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, ffn_hidden=11264, n_experts=64, moe_top_k=6, moe_ffn_hidden=1408,
                              moe_shared_experts=2, moe_norm_topk=True, moe_router="sigmoid", moe_routed_scale=2.446,
                              moe_dense_layers=1, moe_expert_bias_rate=0.001, moe_seq_aux_loss_coeff=0.001,
                              moe_aux_loss_coeff=0.0),
    # moonshotai/Kimi-K2-Base / Kimi-K2-Instruct (model_type kimi_k2, DeepseekV3ForCausalLM): 1T
    # parameters (1.04T in its technical report), 32B active; 64 heads, 384 experts, one dense layer,
    # no groups, YaRN from 4K to 128K (beta_fast = beta_slow = 1), no MTP module; balance losses and
    # bias speed as Moonlight's
    "kimi-k2": dict(_LLAMA, attention_type="mla", n_layer=61, n_head=64, d_model=7168, vocab_size=163840,
                    layernorm_eps=1e-6, seq_len=4096, max_positions=131072, rope_theta=50000.0, rope_scaling="yarn",
                    rope_factor=32.0, rope_original_max_positions=4096, rope_beta_fast=1.0, rope_beta_slow=1.0,
                    rope_mscale=1.0, rope_mscale_all_dim=1.0, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_hidden=18432, n_experts=384,
                    moe_top_k=8, moe_ffn_hidden=2048, moe_shared_experts=1, moe_norm_topk=True,
                    moe_router="sigmoid", moe_routed_scale=2.827, moe_dense_layers=1, moe_expert_bias_rate=0.001,
                    moe_seq_aux_loss_coeff=0.001, moe_aux_loss_coeff=0.0),
}


def preset_config(name: str) -> Config:
    """A fresh Config whose model section is the named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return Config(model=ModelConfig(**PRESETS[name]), preset=name)


def _preset_name(name: Any, source: str) -> str:
    if not isinstance(name, str):
        raise ConfigError(f"{source}preset must be a string, got {name!r}; choose one of {', '.join(PRESETS)}")
    return name


# ------------------------------------------------------------------------ field types
#
# YAML gives whatever its parser makes of the text: PyYAML reads ``lr: 1e-3`` as the
# string "1e-3" (YAML 1.1 wants a dot in a float), ``steps: 2.5`` as a float and
# ``model: 5`` as an int. Each value is therefore checked against its field's annotation
# where it enters the config, so that a wrong type is one line naming ``section.key``
# instead of a traceback deep inside a worker, or after the whole run.


@functools.cache
def field_types(section_class: type) -> dict[str, Any]:
    """Each field's annotation as a type (the annotations are strings in this module)."""
    return typing.get_type_hints(section_class)


def _describe_type(annotation: Any) -> str:
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return f"{_describe_type(inner)} or null"
    if typing.get_origin(annotation) is list:
        return f"a list of {_describe_type(typing.get_args(annotation)[0]).split(' ', 1)[1]}s"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[annotation]


def _as_type(value: Any, annotation: Any) -> Any:
    """``value`` as ``annotation`` wants it; raises TypeError when it is not one.

    Numbers are accepted where floats are expected, and so are strings that spell a
    finite number (YAML's ``1e-3``); bools are never numbers, floats never integers.
    """
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        if value is None:
            return None
        (annotation,) = (a for a in args if a is not type(None))
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is str and isinstance(value, str):
        return value
    if annotation is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except ValueError:
            raise TypeError from None
        if not math.isfinite(number):
            raise TypeError
        return number
    if typing.get_origin(annotation) is list and isinstance(value, list):
        return [_as_type(v, typing.get_args(annotation)[0]) for v in value]
    raise TypeError


def typed_value(section: str, key: str, value: Any, annotation: Any, source: str = "") -> Any:
    """``value`` converted to the field's type, or ConfigError naming section.key."""
    try:
        return _as_type(value, annotation)
    except TypeError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ConfigError(f"{source}{section}.{key} must be {_describe_type(annotation)}, got {shown} "
                          f"({type(value).__name__}); correct the value") from None


def check_types(cfg: Config) -> Config:
    """Every field of ``cfg`` has its annotated type (numbers normalised to float where a
    float is wanted); for configs built in Python rather than read from YAML or flags."""
    _preset_name(cfg.preset, "")
    for section in SECTIONS:
        target = getattr(cfg, section)
        for key, annotation in field_types(type(target)).items():
            setattr(target, key, typed_value(section, key, getattr(target, key), annotation))
    return cfg


def in_range(value: float, rule: str) -> bool:
    """Whether ``value`` satisfies a declared range: ">= x", "> x", "[a, b]", "[a, b)" or "(a, b]"."""
    if rule.startswith(">= "):
        return value >= float(rule[3:])
    if rule.startswith("> "):
        return value > float(rule[2:])
    low, high = (float(x) for x in rule[1:-1].split(","))
    above = low < value if rule.startswith("(") else low <= value
    return above and (value <= high if rule.endswith("]") else value < high)


def range_problem(name: str, value: Any, f: dataclasses.Field) -> str | None:
    """The message for a value outside its field's declared range (None: within it, unset,
    or no range declared); ``name`` is how the message names the field."""
    rule = f.metadata.get("range")
    if rule is None or value is None or in_range(value, rule):
        return None
    within = f"in {rule}" if rule.startswith(("[", "(")) else rule
    return f"{name} must be {within}, got {value}{f.metadata['hint']}"


# (section, key, value) -> the field a value belongs to when one key spells two fields:
# `--attention mla` chooses the attention layer, `--attention math` its core
SHARED_SPELLINGS: dict[tuple[str, str, str | None], str] = {
    ("model", "attention", kind): "attention_type" for kind in ATTENTION_TYPES}


def _update_section(cfg: Config, section: str, values: Any, source: str = "", check_ranges: bool = False) -> None:
    """Set the keys of one section as a file (or a checkpoint, or flags) spells them; a key
    of the layout before the split by topic (``training: {zero: 1}``) reaches its new
    home. Messages name the key as it was written."""
    if values is None:
        return
    if not isinstance(values, dict):
        raise ConfigError(f"{source}section {section} must be a mapping of keys to values, got {values!r}; "
                          f"write it as {section}: {{key: value, ...}}")
    own = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}
    for key, value in values.items():
        key = str(key).replace("-", "_")
        key = SHARED_SPELLINGS.get((section, key, value if isinstance(value, str) else None), key)
        home = section if key in own else MOVED.get((section, key))
        if home is None:
            raise ConfigError(f"{source}unknown key {section}.{key}; known keys: {', '.join(sorted(own))}")
        target = getattr(cfg, home)
        f = target.__dataclass_fields__[key]
        if f.metadata.get("spell") is not None:  # another way a file may write it (a YAML list of sources)
            value = f.metadata["spell"](value, f"{source}{section}.{key}")
        value = typed_value(section, key, value, field_types(type(target))[key], source)
        problem = range_problem(f"{section}.{key}", value, f) if check_ranges else None
        if problem:
            raise ConfigError(f"{source}{problem}")
        setattr(target, key, value)


def _read_yaml(path: str) -> dict[str, Any]:
    """The file's mapping; a syntax error is one line naming the file and the line."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(str(e.problem or e.context or "invalid YAML").split())
        if e.problem and e.context and e.context_mark is not None:
            problem += f" ({e.context}, from line {e.context_mark.line + 1})"
        raise ConfigError(f"--config {path}: {where}{problem}; fix the YAML syntax there") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not UTF-8 text; save it as UTF-8 YAML") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping with sections {', '.join(SECTIONS)}")
    return raw


def load_config(path: str | None, overrides: dict[str, dict[str, Any]] | None = None,
                preset: str | None = None) -> Config:
    """Preset, then the YAML file, then command-line overrides (later wins).

    The preset comes from ``preset`` (a --model flag) or the file's ``preset`` key.
    """
    raw = _read_yaml(path) if path is not None else {}
    source = f"--config {path}: "
    file_preset = _preset_name(raw.get("preset", "tiny"), source)
    cfg = preset_config(preset or file_preset)
    file_cfg = {k: v for k, v in raw.items() if k != "preset"}
    for section in SECTIONS:
        _update_section(cfg, section, file_cfg.pop(section, None), source, check_ranges=True)
    if file_cfg:
        raise ConfigError(f"--config {path}: unknown section(s) {sorted(map(str, file_cfg))}; "
                          f"use {', '.join(SECTIONS)}")
    for section, values in (overrides or {}).items():
        _update_section(cfg, section, {k: v for k, v in values.items() if v is not None})
    return cfg


def given_model_fields(path: str | None, overrides: dict[str, dict[str, Any]] | None = None,
                       preset: str | None = None) -> set[str]:
    """The model fields a run sets itself, by flag, config file or a named preset: what
    ``--init-from`` (which takes the model's shape from its source) must not contradict."""
    raw = _read_yaml(path) if path is not None else {}
    given = {k for k, v in ((overrides or {}).get("model") or {}).items() if v is not None}
    model = raw.get("model")
    given |= {str(k).replace("-", "_") for k in model} if isinstance(model, dict) else set()
    name = preset or raw.get("preset")
    return given | set(PRESETS.get(name, {})) if isinstance(name, str) else given


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def world_size_of(cfg: Config) -> int:
    """The world the run will have: torchrun's WORLD_SIZE, else --nproc, else 1."""
    if under_torchrun() or cfg.parallel.nproc is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return cfg.parallel.nproc
