"""What ``--fp8`` changes in a predicted step: which GEMMs run in float8, what their casts
move, and when the plan refuses it.

The runtime (parallel/float8.py) runs the three GEMMs of every block linear (forward,
input gradient, weight gradient) on float8 operands: the attention projections, the MLPs
and the experts (per token, their weight gradient in bf16, and their grouped GEMMs run
on dequantised operands: costed as bf16 GEMMs plus the casts' and dequantisation's
traffic, slower than bf16, as the runtime is today); not the attention core, the
embedding, the head or the router, nor a column layer whose weight slice several tp
ranks hold (Llama key/value heads when tp exceeds their count, latent attention's
down-projections under tp > 1). The cost model (cost.py) times a float8 GEMM with the
same roofline as a bf16 one, at the machine's FP8 peak (``Machine.peak["fp8"]``) times
the same efficiency, with one-byte operands and a bf16 output, and adds:

* ``RECIPE_SPEED``: rowwise's GEMM at 0.9 of tensorwise's rate. torchao names its
  tensorwise recipe (cuBLAS's per-tensor-scaled kernel) the fastest and its rowwise one
  runs CUTLASS's row-scaled kernel; torchtitan's Llama 3 8B on 8 H100s (torchtitan
  commit 7a04053, compiled, FSDP) ran 5,760 tokens/s in bf16, 6,424 rowwise and 7,186
  tensorwise with float8 all-gathers. Part of that gap is the casts below (rowwise casts
  each operand once per GEMM that reads it) and the all-gathers; 0.9 is the rest, a
  round figure, not a fit;
* the casts, as memory traffic (``CAST_BYTES``: bytes moved per element of each operand,
  by GEMM): a dynamic scale reads the bf16 operand once for its amax and once more to
  write the one-byte cast (2 + 2 + 1 = 5); a weight's scales are the step's (computed once
  after the optimizer), so its cast reads and writes only (3). Tensorwise casts each
  operand once and its backward GEMMs read transposed copies of the casts (read and
  write one byte: 2); rowwise casts every operand again for each GEMM along that GEMM's
  reduction dimension. Eager kernels: ``--compile`` fuses some of these passes into
  their neighbours, which the planner does not model;
* the casts' kernels (``CAST_KERNELS``: about 9 for a dynamic cast, 4 for one with the
  step's scales), each the machine's per-kernel time: on a small model's eager step
  these launches, not the bytes, are the casts' cost;
* the weights' scales: one all-reduce per step of one fp32 amax per float8 weight
  (tensorwise) or one per row and column (rowwise), over the ZeRO-3 shard group and over
  tp (float8.refresh_weight_scales), latency-bound (a tree);
* ``--fp8-all-gather`` (ZeRO-3): the blocks' parameter gathers move one byte an element
  instead of two (the norms and router among them are counted at one byte too: under a
  percent of a block); kept gathered, the step's one gather moves the blocks' share of
  the rank's parameters at one byte (the embedding, final norm and head of a one-stage
  model at two: a bound for any stage).

MFU stays against the bf16 peak (the model FLOPs are the same): a float8 step reaching
40% of the bf16 peak is 20% of the FP8 one.
"""

from __future__ import annotations

from gridtrain.config import FP8_RECIPES

RECIPE_SPEED = {"tensorwise": 1.0, "rowwise": 0.9}
# bytes moved per element of the operands (x: a GEMM's input rows, w: the weight, g: the
# output gradient) by the casts of one linear, for each of its three GEMMs
CAST_BYTES = {
    "tensorwise": {"forward": {"x": 5, "w": 3}, "input_grad": {"g": 5, "w": 2}, "weight_grad": {"g": 2, "x": 2}},
    "rowwise": {"forward": {"x": 5, "w": 3}, "input_grad": {"g": 5, "w": 3}, "weight_grad": {"g": 5, "x": 5}},
}
# eager kernels of the casts of one linear, by GEMM: a dynamic cast about 9 (abs, amax,
# the scale's 4, multiply, clamp, convert), one with the step's scales 4, a transposed
# copy 1 (the kernel-launch side of CAST_BYTES; --compile fuses most of them)
CAST_KERNELS = {
    "tensorwise": {"forward": 9 + 4, "input_grad": 9 + 4, "weight_grad": 4 + 2},
    "rowwise": {"forward": 9 + 4, "input_grad": 9 + 4, "weight_grad": 9 + 9},
}
FP8_GATHER_BYTES = 1  # a float8 weight's element in ZeRO-3's gathers under --fp8-all-gather
SCALE_BYTES = 4  # one fp32 amax


def cast_bytes(recipe: str, rows: int, n: int, k: int, grad_weight: bool = True) -> tuple[float, float]:
    """Bytes the casts of one float8 linear move for ``rows`` input rows of ``k``
    features into ``n`` outputs, as (forward, backward); ``grad_weight`` False: its
    weight gradient runs in bf16 (experts), so no casts for it."""
    table = CAST_BYTES[recipe]
    elements = {"x": rows * k, "w": n * k, "g": rows * n}

    def moved(gemm: str) -> float:
        return float(sum(b * elements[operand] for operand, b in table[gemm].items()))
    return moved("forward"), moved("input_grad") + (moved("weight_grad") if grad_weight else 0.0)


def cast_kernels(recipe: str, grad_weight: bool = True) -> tuple[int, int]:
    """Eager kernels of one float8 linear's casts, as (forward, backward)."""
    table = CAST_KERNELS[recipe]
    return table["forward"], table["input_grad"] + (table["weight_grad"] if grad_weight else 0)


def dequantised_bytes(rows: int, n: int, k: int) -> tuple[float, float]:
    """Bytes the experts' dequantisation moves, as (forward, backward): the runtime runs
    the experts' grouped GEMMs on float8 operands dequantised to bf16 (parallel/float8.py:
    no scaled grouped GEMM yet), reading each one-byte cast and writing it as two bytes
    (the rows and weights forward, the output gradient and weights for the input
    gradient); the GEMMs themselves are bf16's."""
    return 3.0 * (rows * k + n * k), 3.0 * (rows * n + n * k)


def block_float8(m, tp: int, mlp: bool = True) -> list[bool]:
    """Which of cost.block_gemms(m, tokens, tp, mlp) (in its order) run in float8: all
    but a column layer whose weight slice several tp ranks hold (tensor_parallel.
    ColumnParallelLinear with replicas > 1): Llama's k and v where tp exceeds the
    key/value heads, latent attention's q_a and kv_a down-projections under tp > 1."""
    if getattr(m, "mla", False):
        latent = tp > 1
        q = [not latent, True] if m.q_lora_rank else [True]
        attention = q + [not latent, True, True]
    elif m.arch == "llama":
        kv = m.kv_heads >= tp
        attention = [True, kv, kv, True]
    else:
        attention = [True, True]
    width = 3 if m.arch == "llama" else 2
    return attention + ([True] * width if mlp else [])


def scale_count(recipe: str, shapes: list[tuple[int, int, int]], flags: list[bool]) -> int:
    """fp32 amaxes of the float8 weights among ``shapes`` (GEMMs' forward (m, n, k), the
    weight ``n x k``) that the step's scale all-reduce carries: one per weight
    (tensorwise), one per row and column (rowwise)."""
    return sum((1 if recipe == "tensorwise" else n + k) for (_, n, k), f in zip(shapes, flags) if f)


def refusal(fp8: str, fp8_all_gather: bool, dtype: str, hardware, zero: int | None) -> str | None:
    """Why ``plan`` cannot take these float8 flags (one line, as ``train`` refuses them),
    or None. ``hardware``: the machine (its ``peak`` has "fp8" only with FP8 Tensor
    Cores); ``zero``: the fixed stage (None: searched)."""
    if fp8 not in FP8_RECIPES:
        return f"plan: --fp8 {fp8} is not one of {', '.join(FP8_RECIPES)}"
    if fp8_all_gather and fp8 == "none":
        return "plan: --fp8-all-gather gathers float8 weights, and this plan has --fp8 none; pass --fp8 " \
               "tensorwise or rowwise, or drop it"
    if fp8_all_gather and zero is not None and zero != 3:
        return f"plan: --fp8-all-gather casts ZeRO-3's parameter gathers, and this plan fixes --zero {zero}; " \
               "pass --zero 3 (or leave --zero to the search) or drop it"
    if fp8 == "none":
        return None
    if dtype != "bf16":
        return f"plan: --fp8 {fp8} runs float8 GEMMs inside a bf16 run, and this plan has --dtype {dtype}; " \
               "pass --dtype bf16"
    if "fp8" not in hardware.peak:
        return f"plan: --fp8 {fp8} needs FP8 Tensor Cores, which the {hardware.name} does not have; plan it on " \
               "--hardware h100-sxm or h200, or drop --fp8"
    return None
