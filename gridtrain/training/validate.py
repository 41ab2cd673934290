"""Everything about a configuration that can be checked before a process starts.

Why one module: a bad input found inside the workers costs a traceback per rank (or,
for an output path, a whole run lost at its first save), while the same input found
here costs one line on stderr and exit status 2. :func:`validate` is therefore the one
gate that every entry point passes: ``gridtrain train`` calls it in the launching
process before any worker is spawned, and :func:`gridtrain.training.loop.pretrain` calls it
again at its start, so torchrun workers and the Python API are refused with the same
line. It is idempotent, has no side effects (it creates nothing) and takes well under
a second for the built-in corpus, so running it in every worker is cheap.

What it checks, in order, each message naming the flag (or ``section.key`` for fields
without one; both come from the field's declaration), the problem and the fix:

* types: every field against its dataclass annotation (config.check_types);
* ranges and choices: every number within its meaning (steps >= 1, betas in [0, 1),
  ...) and every named option one of its values, as each field's declaration in
  gridtrain.config says;
* the learning-rate schedule: wsd's decay flags only with wsd, its warm-up and decay
  within the run;
* sizes: the grid against the world, heads and MLP against tp, the pipeline split,
  the batch against micro-batch x dp, recomputation settings;
* data: the corpus exists, is readable, has a recognised format and holds a
  validation window plus one global batch of training windows (gridtrain.data's
  ``count_tokens`` and ``check_enough_tokens``, the same code that refuses at load);
* the tokenizer exists, parses and fits the vocabulary;
* outputs: ``--save``, ``--trace``, ``--tensorboard`` and ``--metrics-file`` can be
  created (the nearest existing ancestor is a writable directory; nothing is made);
* ``--load`` (or ``--auto-resume``'s checkpoint in ``--save``): complete, undamaged
  and of the same model (gridtrain.checkpoint.check_loadable);
* ``--init-from``: a Hugging Face directory checked whole (config, index, every tensor
  and its shape) or a checkpoint as for ``--load``, holding the run's model
  (gridtrain.checkpoint.huggingface.check_init_from);
* host resources: local ``--nproc`` workers on CPU that this host cannot hold.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from gridtrain.checkpoint import CheckpointError, check_loadable, latest_step_dir
from gridtrain.config import (ROPE_SCALINGS, ActivationsConfig, Config, ConfigError, DataConfig, ModelConfig,
                              OptimConfig, ParallelConfig, TrainingConfig, check_types, declared_fields, flag_of,
                              range_problem, under_torchrun, world_size_of)
from gridtrain.data import DataError, check_enough_tokens, count_tokens, load_tokenizer
from gridtrain.data.mixture import parse_sources
from gridtrain.data.sft import SFTDataset, is_sft_jsonl
from gridtrain.data.token_files import find_token_header, largest_id
from gridtrain.runtime.devices import gpu_shortage, shares_gpus
from gridtrain.parallel.context_parallel import split_problem
from gridtrain.parallel.float8 import capability_problem as float8_capability_problem, torchao_problem
from gridtrain.parallel.grid import GridError, ProcessGrid
from gridtrain.checkpoint.huggingface import HFError, check_init_from
from gridtrain.runtime.launch import resolve_device_type
from gridtrain.training.metrics import require_tensorboard
from gridtrain.models.decoder import count_parameters
from gridtrain.memory.model import expected_startup_bytes
from gridtrain.optim.schedules import wsd_problem
from gridtrain.parallel.pipeline.partition import METHODS, PartitionError, check_counts
from gridtrain.parallel.pipeline.schedules import ORDERS, ScheduleError, check_sizes

FIELDS = {(section, f.name): f for section, f in declared_fields()}  # (section, key) -> its declaration

WORKER_MEMORY = 250 << 20  # one worker's footprint before its model: python, torch, gloo
CORES_PER_WORKER = 1 / 8  # more than 8 workers per core only thrash


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def field_name(section: str, key: str) -> str:
    """How a message names a field: ``--flag`` where there is one, else ``section.key``."""
    return flag_of(FIELDS[section, key]) or f"{section}.{key}"


def _validate_declared(cfg: Config) -> None:
    """Every field within its declared range and among its declared choices."""
    for (section, key), f in FIELDS.items():
        value = getattr(getattr(cfg, section), key)
        problem = range_problem(field_name(section, key), value, f)
        _require(problem is None, problem or "")
        choices = f.metadata.get("choices")
        _require(choices is None or value is None or value in choices,
                 f"{field_name(section, key)} {value!r} is not one of {', '.join(map(str, choices or ()))}")


def _validate_model(m: ModelConfig) -> None:
    _require(m.d_model % m.n_head == 0 or (m.arch == "llama" and m.attn_head_dim is not None),
             f"--n-head {m.n_head} does not divide --d-model {m.d_model}; "
             "choose a head count that divides d_model")
    if m.arch == "llama":
        _validate_llama(m)
    else:
        _require(m.qk_norm is None and m.attn_head_dim is None,
                 "model.qk_norm and model.attn_head_dim are for --arch llama (GPT-2's heads are d_model / n_head "
                 "wide, without query/key norms); drop them or pass --arch llama")
        _require(m.n_kv_head in (None, m.n_head),
                 f"--n-kv-head {m.n_kv_head}: GPT-2 has one key/value head per query head; "
                 "drop --n-kv-head or pass --arch llama")
        _require(m.rope_scaling is None, "model.rope_scaling is for --arch llama (GPT-2 has learned positions); "
                                         "drop it or pass --arch llama")


def _validate_llama(m: ModelConfig) -> None:
    """Grouped-query attention and rotary positions fit the shape."""
    _require(m.n_head % m.kv_heads == 0,
             f"--n-kv-head {m.kv_heads} does not divide --n-head {m.n_head}; "
             "choose a key/value head count that divides the head count")
    _require(m.head_dim % 2 == 0,
             f"rotary embeddings turn pairs of dimensions, but the head size "
             f"{'model.attn_head_dim' if m.attn_head_dim else f'd_model / n_head = {m.d_model} / {m.n_head}'} = "
             f"{m.head_dim} is odd; choose an even head size")
    _require(m.rope_scaling in (None, *ROPE_SCALINGS),
             f"model.rope_scaling {m.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)} (or null)")
    _require(m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor,
             f"model.rope_high_freq_factor {m.rope_high_freq_factor} must exceed model.rope_low_freq_factor "
             f"{m.rope_low_freq_factor}")
    _require(m.rope_scaling != "yarn" or m.rope_beta_fast >= m.rope_beta_slow,  # equal: Kimi K2's 1.0 and 1.0
             f"model.rope_beta_fast {m.rope_beta_fast} must be at least model.rope_beta_slow {m.rope_beta_slow}")
    if m.mla:
        _require(m.qk_rope_head_dim % 2 == 0,
                 f"--qk-rope-head-dim {m.qk_rope_head_dim} is odd: rotary embeddings turn pairs of dimensions; "
                 "choose an even width")
        _require(m.qk_norm is None, "model.qk_norm with --attention mla: latent attention normalises its "
                                    "compressed query and key/value instead; drop qk_norm")


def _validate_new_parts(m: ModelConfig, d: DataConfig) -> None:
    """Latent attention, multi-token prediction and DeepSeek-V3's routing fit the model."""
    _require(not m.mla or m.arch == "llama",
             "--attention mla is a Llama-family layer (rotary positions, RMSNorm); pass --arch llama")
    _require(m.mtp_layers == 0 or m.arch == "llama",
             f"--mtp-layers {m.mtp_layers}: multi-token prediction modules are Llama-family blocks; pass --arch llama")
    _require(m.mtp_layers < m.seq_len - 1,
             f"--mtp-layers {m.mtp_layers} predicts {m.mtp_layers + 1} tokens ahead, past a --seq-len {m.seq_len} "
             "window; use fewer depths or a longer sequence")
    if m.n_experts == 0:
        for flag, used in (("--moe-router sigmoid", m.moe_router != "softmax"),
                           ("--moe-expert-bias-rate", m.moe_expert_bias_rate > 0),
                           ("--moe-groups", m.moe_groups > 1), ("--moe-dense-layers", m.moe_dense_layers > 0),
                           ("--moe-seq-aux-loss-coeff", m.moe_seq_aux_loss_coeff > 0)):
            _require(not used, f"{flag} routes experts, and this model has none; pass --n-experts or drop it")
        return
    _require(m.n_experts % m.moe_groups == 0,
             f"--moe-groups {m.moe_groups} does not divide --n-experts {m.n_experts}; choose a group count that "
             "divides the expert count")
    top_groups = m.moe_group_top_k or m.moe_groups
    _require(top_groups <= m.moe_groups,
             f"--moe-group-top-k {top_groups} exceeds --moe-groups {m.moe_groups}; choose at most every group")
    _require(m.moe_groups == 1 or m.moe_top_k <= top_groups * (m.n_experts // m.moe_groups),
             f"--moe-top-k {m.moe_top_k} exceeds the {top_groups * (m.n_experts // m.moe_groups)} experts of the "
             f"{top_groups} groups a token may use; raise --moe-group-top-k or lower --moe-top-k")
    _require(m.moe_groups == 1 or m.n_experts // m.moe_groups >= 2,
             f"--moe-groups {m.moe_groups}: a group's score is its two best experts; give each group two or more")
    _require(m.moe_dense_layers < m.n_layer,
             f"--moe-dense-layers {m.moe_dense_layers} leaves no MoE layer of {m.n_layer}; use fewer dense layers "
             "or --n-experts 0")


def _validate_training(t: TrainingConfig) -> None:
    _require(t.seed < 2 ** 63, f"--seed must be < 2**63, got {t.seed}; choose a smaller seed")


def _validate_schedule(o: OptimConfig, t: TrainingConfig) -> None:
    """The decay flags belong to wsd (given with another schedule they would be ignored, and
    the run would not decay as asked); wsd's warm-up and decay fit in the run."""
    given = [flag for flag, value in (("--lr-decay-fraction", o.lr_decay_fraction),
                                      ("--lr-decay-shape", o.lr_decay_shape)) if value is not None]
    _require(o.lr_schedule == "wsd" or not given,
             f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the decay of --lr-schedule wsd, "
             f"not --lr-schedule {o.lr_schedule}; pass --lr-schedule wsd or drop {'them' if len(given) > 1 else 'it'}")
    problem = wsd_problem(o, t.steps)
    _require(problem is None, problem or "")


def _validate_optimizer(o: OptimConfig, m, p) -> None:
    """Muon's own rate needs Muon; QK-clip needs logits that scale with the query and key
    weights (no q/k norms) and key heads held by one tp rank each."""
    _require(o.muon_lr is None or o.optimizer == "muon",
             f"--muon-lr sets Muon's rate, not --optimizer {o.optimizer}'s; pass --optimizer muon or drop it")
    if o.qk_clip > 0:
        _require(not m.qk_norm, f"--qk-clip rescales query and key weights, which --qk-norm {m.qk_norm} "
                                "normalises away; drop one of them")
        _require(m.arch != "llama" or m.mla or p.tp <= m.kv_heads,
                 f"--qk-clip with --tp {p.tp} above the {m.kv_heads} key/value heads (replicated over tp ranks) is not "
                 f"supported; use --tp {m.kv_heads} or fewer")


def _validate_fp8(t: TrainingConfig, p: ParallelConfig) -> None:
    """Float8 GEMMs: a bf16 run, torchao installed, what they do not compose with yet."""
    _require(not t.fp8_all_gather or t.fp8 != "none",
             "--fp8-all-gather gathers float8 weights, and this run has --fp8 none; pass --fp8 tensorwise or "
             "rowwise, or drop it")
    _require(not t.fp8_all_gather or p.zero == 3,
             f"--fp8-all-gather casts ZeRO-3's parameter gathers, and this run has --zero {p.zero}; pass --zero 3 "
             f"or drop it")
    if t.fp8 == "none":
        return
    _require(t.dtype == "bf16", f"--fp8 {t.fp8} runs float8 GEMMs inside a bf16 run, and this run has --dtype "
                                f"{t.dtype}; pass --dtype bf16")
    problem = torchao_problem()
    _require(problem is None, problem or "")


def _validate_recompute(a: ActivationsConfig, t: TrainingConfig) -> None:
    _require(a.recompute == "full" or (a.recompute_method == "uniform" and a.recompute_layers == 1),
             f"--recompute-method/--recompute-layers choose blocks for --recompute full, "
             f"not --recompute {a.recompute}; pass --recompute full or drop them")
    for flag, on in (("--recompute-keep-last", a.recompute_keep_last), ("--recompute-early", a.recompute_early)):
        _require(not on or a.recompute != "none",
                 f"{flag} needs recomputation; pass --recompute selective or full")
    _require(t.compile or t.compile_backend == "inductor",
             f"--compile-backend {t.compile_backend} chooses how --compile compiles; add --compile or drop "
             f"--compile-backend")
    _require(not (t.compile and a.recompute == "selective"),
             "--compile does not take --recompute selective yet (its recomputed attention core, inside a "
             "block, breaks the compiled graph); use --recompute full or none with --compile")


def _validate_document_mask(d: DataConfig, t: TrainingConfig) -> None:
    """What document masking does not compose with yet."""
    _require(not (d.document_mask and t.compile),
             "--compile does not take --document-mask yet (compiled blocks take no document mask); "
             "drop --compile or --document-mask")


def _validate_parallel(p: ParallelConfig, world_size: int) -> None:
    _require(p.schedule in ORDERS, f"--schedule {p.schedule!r} is not one of {', '.join(ORDERS)}")
    _validate_zero(p)
    _require(p.nproc is None or not under_torchrun() or p.nproc == world_size,
             f"--nproc {p.nproc} differs from torchrun's {world_size} workers; drop --nproc under torchrun")
    try:
        grid = ProcessGrid.build(world_size, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
    except GridError as e:
        raise ConfigError(str(e)) from None
    replicas = grid.dp * grid.cp
    _require(p.zero_shard_size is None or replicas % p.zero_shard_size == 0,
             f"--zero-shard-size {p.zero_shard_size} does not divide the {replicas} data-parallel x cp ranks; "
             f"pass a divisor of {replicas}")


def _validate_zero(p: ParallelConfig) -> None:
    """ZeRO's options fit its stage and the data-parallel (x cp) group it shards over."""
    _require(not p.zero3_keep_gathered or p.zero == 3,
             f"--zero3-keep-gathered keeps ZeRO-3's gathered parameters, and this run has --zero {p.zero}; "
             f"pass --zero 3 or drop it")
    if p.zero_shard_size is not None:
        _require(p.zero >= 1, f"--zero-shard-size {p.zero_shard_size} shards ZeRO state, and this run has --zero 0; "
                              f"pass --zero 1, 2 or 3 or drop it")


def _validate_context_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """Each cp rank must hold two whole chunks of every sequence (and, under sequence
    parallelism, a share that tp divides); what cp cannot reproduce is refused."""
    if p.cp == 1:
        return
    problem = split_problem(m.seq_len, p.cp)
    _require(problem is None, f"--cp {p.cp}: {problem}")
    local = m.seq_len // p.cp
    _require(not (p.sequence_parallel and p.tp > 1) or local % p.tp == 0,
             f"--sequence-parallel with --cp {p.cp}: --tp {p.tp} does not divide the {local} tokens each cp rank "
             f"holds (--seq-len / cp); choose a sequence length that is a multiple of "
             f"{math.lcm(2 * p.cp, p.cp * p.tp)}")
    _require(m.dropout == 0,
             f"--dropout {m.dropout} with --cp {p.cp}: dropout masks under context parallelism would not be the "
             "one-process masks (each rank draws for its own tokens); use --dropout 0 (as Llama and long-context "
             "runs train) or --cp 1")


def _validate_experts(m: ModelConfig, p: ParallelConfig, t: TrainingConfig, replicas: int) -> None:
    """Experts split evenly over ep, ep carved out of the dp x cp ranks (``replicas``);
    what MoE does not compose with yet is refused."""
    if m.n_experts == 0:
        _require(p.ep == 1, f"--ep {p.ep} splits experts, and this model has none; pass --n-experts or drop --ep")
        _require(p.etp == 1, f"--etp {p.etp} splits experts, and this model has none; pass --n-experts or drop "
                             f"--etp")
        return
    _require(m.moe_top_k <= m.n_experts,
             f"--moe-top-k {m.moe_top_k} exceeds --n-experts {m.n_experts}; route to at most every expert")
    _require(m.n_experts % p.ep == 0,
             f"--ep {p.ep} does not divide --n-experts {m.n_experts}; choose an ep that divides the expert count")
    stage = replicas * p.tp  # the tp x cp x dp ranks of a pipeline stage, over which experts may fold
    _require(stage % (p.ep * p.etp) == 0,
             f"--ep {p.ep} x --etp {p.etp} does not divide the {stage} tp x cp x dp ranks of a pipeline stage the "
             f"expert grid is laid over; choose ep x etp dividing tp x cp x dp")
    folded = replicas % (p.ep * p.etp) != 0  # grid.ProcessGrid.folds_experts: the expert groups span tp ranks
    _require(not folded or p.sequence_parallel,
             f"--ep {p.ep} x --etp {p.etp} does not divide the {replicas} data-parallel x cp ranks, so experts fold "
             f"over tp, and without --sequence-parallel the tp ranks hold the same tokens; pass --sequence-parallel "
             f"(or ep x etp dividing dp x cp)")
    if p.etp > 1:
        _require(m.moe_ffn_size % p.etp == 0,
                 f"--etp {p.etp} does not divide the experts' width {m.moe_ffn_size}; choose an etp that divides "
                 f"--moe-ffn-hidden")
        _require(m.arch == "llama", f"--etp {p.etp} with --arch gpt2: GPT-2 experts' output bias is not split over "
                                    f"etp; use --etp 1 or --arch llama")
        _require(m.moe_capacity_factor is None,
                 f"--etp {p.etp} with --moe-capacity-factor: capacity drops by token order, which pooling tokens "
                 f"over the etp group does not keep yet; drop one of them")
    _require(m.moe_shared_experts == 0 or (m.moe_shared_experts * m.moe_ffn_size) % p.tp == 0,
             f"--tp {p.tp} does not divide the shared experts' width {m.moe_shared_experts * m.moe_ffn_size}; "
             f"choose a tp that divides it")
    _require(p.ep == 1 or p.zero_shard_size is None,
             f"--zero-shard-size with --ep {p.ep}: hybrid sharding of experts over their own group is not built "
             f"yet; drop one of them")
    _require(p.etp == 1 or p.zero_shard_size is None,
             f"--zero-shard-size with --etp {p.etp}: hybrid sharding of experts over their own group is not built "
             f"yet; drop one of them")
    _require(not t.compile, "--compile with --n-experts: MoE layers size their tensors by the routing counts "
                            "(host reads inside the block); not compiled yet, drop --compile")


def _validate_tensor_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """Each TP rank must own whole heads, an equal MLP slice and (under SP) sequence slice."""
    _require(m.n_head % p.tp == 0,
             f"--tp {p.tp} does not divide --n-head {m.n_head}; choose a tp that divides the head count")
    kv = m.kv_heads
    fix = f"choose a tp that divides {kv} or is a multiple of it"
    if p.tp <= kv:
        _require(kv % p.tp == 0, f"--tp {p.tp} does not divide --n-kv-head {kv}; {fix}")
    else:
        _require(p.tp % kv == 0, f"--tp {p.tp} exceeds --n-kv-head {kv} but is not a multiple of it (each "
                                 f"key/value head is replicated on tp / n_kv_head ranks); {fix}")
    _require(m.ffn_size % p.tp == 0,
             f"--tp {p.tp} does not divide the MLP width {m.ffn_size}; choose a tp that divides it")
    _require(not p.sequence_parallel or m.seq_len % p.tp == 0,
             f"--sequence-parallel: --tp {p.tp} does not divide --seq-len {m.seq_len}; "
             "choose a sequence length that tp divides")


def _validate_pipeline(cfg: Config, dp: int) -> None:
    """Schedule, chunk count and layer split fit the model and the micro-batch count."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    stages = p.pp * p.vpp
    if t.global_batch_size % (t.micro_batch_size * dp) == 0:
        try:
            check_sizes(p.schedule, p.pp, t.global_batch_size // (t.micro_batch_size * dp), p.vpp)
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
    if p.pp_layers is not None:
        try:
            check_counts(p.pp_layers, stages, m.n_layer)
        except PartitionError as e:
            raise ConfigError(str(e)) from None
    else:
        _require(p.pp_partition in METHODS,
                 f"--pp-partition {p.pp_partition!r} is not one of {', '.join(METHODS)}")
        _require(m.n_layer >= stages, f"--n-layer {m.n_layer} is fewer than pp x vpp = {stages} stages; "
                                      "lower --pp/--vpp or give --pp-layers")
    _require(not cfg.activations.recompute_early or p.pp > 1,
             "--recompute-early overlaps recomputation with the wait for the next stage's gradient; "
             "it needs --pp > 1")
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"--global-batch-size {t.global_batch_size} is not divisible by "
             f"--micro-batch-size {t.micro_batch_size} x dp {dp}; make it a multiple of "
             f"{t.micro_batch_size * dp}")


def _validate_data(d: DataConfig, m: ModelConfig, t: TrainingConfig) -> None:
    """The tokenizer fits the vocabulary and the corpus holds enough windows.

    The corpus is counted as gridtrain.data counts it at load, and refused with the
    same message (see data.count_tokens for what is read and what is bounded).
    """
    if d.tokenizer is not None:
        _require(Path(d.tokenizer).is_file(), f"--tokenizer {d.tokenizer}: no such file")
    try:
        tokenizer = load_tokenizer(d.tokenizer)
        _require(tokenizer.vocab_size <= m.vocab_size,
                 f"the tokenizer has {tokenizer.vocab_size} tokens but --vocab-size is "
                 f"{m.vocab_size}; pass --vocab-size {tokenizer.vocab_size}")
        sources = parse_sources(d.path)
        held = parse_sources(d.valid_data, "--valid-data") if d.valid_data is not None else []
        # one source needs a global batch of training windows; a mixture's source wraps (and says so);
        # with --valid-data nothing is held out of the training sources
        batch = t.global_batch_size if len(sources) == 1 else 1
        for source, enough, held_out, flag in [(s, batch, None if held else d.valid_every, "--data") for s in sources] + \
                [(s, 1, None, "--valid-data") for s in held]:
            if source.path is not None and is_sft_jsonl(source.path):
                # every record read and checked, tokenized and packed as the workers will: a source
                # with no label that carries a loss would train (or validate) on 0 / 0
                SFTDataset(source.path, tokenizer, m.seq_len).check_loss_tokens(flag, source.path)
                continue
            count, exact = count_tokens(source.path, tokenizer)
            check_enough_tokens(count, source.path, m.seq_len, enough, held_out, exact)
            if source.path is not None and find_token_header(source.path) is not None:
                top = largest_id(source.path)  # the header's, or one pass over an older file
                _require(top < m.vocab_size, f"{flag} {source.path}: the token file holds ids up to {top}, outside "
                                             f"--vocab-size {m.vocab_size}; pass --vocab-size {top + 1} or more, "
                                             "or prepare the corpus with the model's tokenizer")
    except DataError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # e.g. a folder on the way that may not be listed
        raise ConfigError(f"--data {d.path}: cannot be read ({e.strerror or e}); fix its permissions") from None


def _check_writable(flag: str, path: str, directory: bool) -> None:
    """``path`` can be written as a directory (or a file) without creating anything now:
    it is one already, or its nearest existing ancestor is a writable directory."""
    target = Path(path)
    if target.exists():
        if directory:
            _require(target.is_dir(), f"{flag} {path}: exists and is not a directory; "
                                      "choose a directory path (or remove the file)")
        else:
            _require(not target.is_dir(), f"{flag} {path}: is a directory; give a file path")
        _require(os.access(target, os.W_OK | (os.X_OK if directory else 0)),
                 f"{flag} {path}: not writable; fix its permissions or choose another path")
        return
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    _require(ancestor.is_dir(), f"{flag} {path}: {ancestor} is a file, not a directory; choose another path")
    _require(os.access(ancestor, os.W_OK | os.X_OK),
             f"{flag} {path}: cannot be created, {ancestor} is not writable; choose a writable location")


def _validate_outputs(cfg: Config) -> None:
    """Every output can be written, so that no run is lost at its first save; the
    packages optional outputs need are installed."""
    c, r = cfg.checkpoint, cfg.metrics
    for flag, path, directory in (("--save", c.save, True), ("--trace", r.trace, True),
                                  ("--tensorboard", r.tensorboard, True),
                                  ("--metrics-file", r.metrics_file, False)):
        if path is not None:
            _require(path != "", f"{flag}: empty path; give a path or leave the flag out")
            try:
                _check_writable(flag, path, directory)
            except OSError as e:  # a folder on the way that may not be searched
                raise ConfigError(f"{flag} {path}: cannot be checked ({e.strerror or e}); "
                                  "choose a writable location") from None
    if r.tensorboard is not None:
        try:
            require_tensorboard()
        except ImportError as e:
            raise ConfigError(str(e)) from None


def _validate_checkpoint(cfg: Config) -> None:
    """The checkpoint the run would start from is complete, undamaged and of this model:
    ``--load``, or with ``--auto-resume`` the newest one in ``--save`` (none: a fresh start)."""
    c = cfg.checkpoint
    try:
        if c.load is not None:
            check_loadable(c.load, cfg)
        elif c.auto_resume and c.save is not None:
            source = latest_step_dir(c.save)
            if source is not None:
                check_loadable(source, cfg)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    _require(not c.auto_resume or c.save is not None or c.load is not None,
             "--auto-resume resumes from the --save directory; pass --save DIR")
    _require(not c.save_async or c.save is not None, "--save-async writes checkpoints to --save; pass --save DIR")
    _require(not c.keep_last or c.save is not None, "--keep-last prunes the --save directory; pass --save DIR")


def _validate_init_from(cfg: Config) -> None:
    """``--init-from``: not beside ``--load``; its source is whole (a Hugging Face
    directory's config, index and tensors; a checkpoint's manifest) and holds this model."""
    c = cfg.checkpoint
    if c.init_from is None:
        return
    _require(c.load is None, "--init-from starts a new run from a model's weights and --load resumes a run; "
                             "pass one of them")
    try:
        check_init_from(cfg)
    except (HFError, CheckpointError) as e:
        raise ConfigError(str(e)) from None


def available_memory() -> int | None:
    """Bytes of memory available to new processes (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def worker_memory(cfg: Config) -> int:
    """A rough lower bound on one CPU worker's memory: the interpreter with torch, plus the
    largest start-up peak of the layout's ranks (memory.model.expected_startup_bytes:
    its weights, gradients and optimizer state as its ZeRO stage shards them, and one
    whole tensor); where the layout cannot be laid out yet, 16 bytes a parameter over
    tp x pp."""
    p = cfg.parallel
    try:
        grid = ProcessGrid.build(p.nproc, tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp)
        return WORKER_MEMORY + max(expected_startup_bytes(cfg, grid, r) for r in range(grid.world_size))
    except (GridError, ValueError, ZeroDivisionError):
        return WORKER_MEMORY + 16 * count_parameters(cfg.model) // (p.tp * p.pp)


def _validate_host(cfg: Config) -> None:
    """Local workers on CPU that this host cannot hold are refused before forking them.

    Only for ``--nproc`` in the launching process: under torchrun (or inside a worker,
    where RANK is set) the world is the launcher's business.
    """
    p, t = cfg.parallel, cfg.training
    if p.nproc is None or under_torchrun() or "RANK" in os.environ:
        return
    if resolve_device_type(t.device) != "cpu":
        return
    cores = os.cpu_count() or 1
    limit = int(cores / CORES_PER_WORKER)
    memory = available_memory()
    need = worker_memory(cfg)
    if memory is not None:
        limit = min(limit, max(memory // need, 1))
    if p.nproc > limit:
        held = f"{cores} CPU cores" + (f", {memory / 2 ** 30:.1f} GiB available at about "
                                       f"{math.ceil(need / 2 ** 20)} MiB a worker" if memory is not None else "")
        raise ConfigError(f"--nproc {p.nproc} is more workers than this host can run ({held}); "
                          f"lower --nproc to at most {limit}, or launch across hosts with torchrun")


def local_workers(p: ParallelConfig) -> tuple[int, str, bool]:
    """How many workers of this run are on this node, where that number comes from (for
    the message): the launcher's LOCAL_WORLD_SIZE (torchrun's ``--nproc-per-node``), else
    ``--nproc``, else one process; and whether they are known to see the same GPUs
    (``--nproc``'s workers do; a launcher's may each see one GPU of their own)."""
    if under_torchrun() or (p.nproc is None and "LOCAL_WORLD_SIZE" in os.environ):
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return n, f"LOCAL_WORLD_SIZE={n} (torchrun --nproc-per-node)", False
    if p.nproc is not None:
        return p.nproc, f"--nproc {p.nproc}", True
    return 1, "one process", True


def _validate_cuda(p: ParallelConfig, t: TrainingConfig) -> None:
    """A run on cuda -- asked for, or the default where a GPU is visible -- needs one GPU
    per worker on this node (NCCL refuses two ranks on one GPU); refused here, before any
    worker is spawned, with the rule the workers themselves apply
    (:func:`gridtrain.runtime.devices.gpu_shortage`): ``--nproc N`` needs N visible GPUs; a
    launcher's workers that each see one GPU have one each."""
    if resolve_device_type(t.device) != "cuda":
        _require(t.backend != "nccl", "--backend nccl needs --device cuda; use --backend gloo (the default on cpu)")
        return
    _require(torch.cuda.is_available(), "--device cuda: no CUDA device is available; use --device cpu")
    if t.fp8 != "none":  # torch._scaled_mm would fail at the first forward, after the build and compile
        for i in range(torch.cuda.device_count()):
            problem = float8_capability_problem(t.fp8, torch.cuda.get_device_capability(i),
                                                f"GPU {i} ({torch.cuda.get_device_name(i)})")
            _require(problem is None, problem or "")
    if shares_gpus(t.backend):  # gloo: ranks may share a GPU
        return
    workers, source, same_gpus = local_workers(p)
    problem = gpu_shortage(workers, torch.cuda.device_count(), source, same_gpus)
    _require(problem is None, problem or "")


def validate(cfg: Config, world_size: int | None = None, *, data: bool = True) -> Config:
    """Check everything that can be checked without starting a process; raise ConfigError.

    ``world_size`` defaults to the world the run will have (torchrun's WORLD_SIZE, else
    ``--nproc``, else 1); callers that build a smaller grid inside a larger world pass it.
    ``data=False`` skips the corpus and tokenizer (the ``data`` section and its fit to the
    vocabulary), for Python-API runs whose own datasets provider ignores that section.
    Returns ``cfg`` (numbers given as ints or numeric strings for float fields become
    floats; nothing else changes), so calling it twice is the same as once.
    """
    check_types(cfg)
    if world_size is None:
        world_size = world_size_of(cfg)
    p, t, m = cfg.parallel, cfg.training, cfg.model
    _validate_declared(cfg)
    _validate_model(m)
    _validate_new_parts(m, cfg.data)
    _validate_training(t)
    _validate_schedule(cfg.optim, t)
    _validate_optimizer(cfg.optim, m, p)
    _validate_recompute(cfg.activations, t)
    _validate_fp8(t, p)
    _validate_document_mask(cfg.data, t)
    _validate_parallel(p, world_size)
    _validate_host(cfg)
    _validate_cuda(p, t)
    _validate_tensor_parallel(m, p)
    _validate_context_parallel(m, p)
    _validate_experts(m, p, t, world_size // (p.tp * p.pp))
    _validate_pipeline(cfg, world_size // (p.tp * p.cp * p.pp))
    if data:
        _validate_data(cfg.data, m, t)
    _validate_outputs(cfg)
    _validate_checkpoint(cfg)
    _validate_init_from(cfg)
    return cfg
