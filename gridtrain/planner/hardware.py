"""Published figures for the GPUs ``gridtrain plan`` knows, one frozen ``Hardware`` each.

``HARDWARE`` maps a short key ("a100-40gb", "a100-80gb", "h100-sxm", "h200") to the
vendor's peak numbers for one GPU of that kind in its usual 8-GPU DGX/HGX node. They are
peaks, not what a training step achieves: Narayanan et al. 2021 reach 44-52% of the A100
16-bit peak end to end (see ``published.py``), and the planner is expected to apply its
own efficiency factors.

Conventions (every field is per GPU):

* FLOP/s are dense (no 2:4 structured sparsity). NVIDIA's H100/H200 tables print the
  Tensor Core figures with sparsity and state that dense is half; the dense value here is
  that printed figure halved. fp32 is the non-tensor (CUDA core) rate; TF32 Tensor Core
  rates are not used. ``peak_tflops_fp8`` is the dense FP8 (e4m3/e5m2) Tensor Core rate,
  None on a GPU without FP8 Tensor Cores (Ampere): ``--fp8`` is refused there.
* GB and GB/s are decimal (10**9 bytes), as NVIDIA prints them. ``memory_gb`` is the
  nominal capacity; what CUDA reports as usable is somewhat lower, so a memory check
  should leave headroom or read the device's own total.
* ``nvlink_gbs_per_direction`` is half of NVIDIA's NVLink figure, which is the
  bidirectional total per GPU (A100: 12 links, 600 GB/s total; H100/H200: 18 links,
  900 GB/s total).
* ``network_gbs_per_gpu`` is the inter-node bandwidth one GPU has in each direction:
  DGX A100 and DGX H100/H200 give every GPU its own InfiniBand adapter (HDR 200 Gb/s and
  NDR 400 Gb/s respectively), so it is the adapter's line rate / 8 bits.

Sources are in each entry's ``source`` and, number by number, in docs/planner-sources.md,
which also lists what could not be read from NVIDIA's own page in this pass.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one accelerator (or, for "cpu", of one calibrated host)."""

    name: str
    peak_tflops_bf16: float  # dense Tensor Core
    peak_tflops_fp16: float  # dense Tensor Core
    peak_tflops_fp32: float  # non-tensor
    memory_gb: float
    memory_bandwidth_gbs: float
    nvlink_gbs_per_direction: float
    network_gbs_per_gpu: float  # inter-node, per direction
    gpus_per_node: int
    source: str
    notes: str = ""
    peak_tflops_fp8: float | None = None  # dense FP8 Tensor Core; None: no FP8 Tensor Cores

    def peak_tflops(self, dtype: object) -> float:
        """Peak TFLOP/s for a dtype or its name ("bf16"/"bfloat16", "fp16"/"float16"/"half",
        "fp32"/"float32"/"float", "fp8"/"float8" and the float8 formats); ValueError for
        anything else, and for fp8 on a GPU without FP8 Tensor Cores."""
        key = str(dtype).lower().removeprefix("torch.")
        if key in ("bf16", "bfloat16"):
            return self.peak_tflops_bf16
        if key in ("fp16", "float16", "half"):
            return self.peak_tflops_fp16
        if key in ("fp32", "float32", "float"):
            return self.peak_tflops_fp32
        if key in FP8_NAMES:
            if self.peak_tflops_fp8 is None:
                raise ValueError(f"the {self.name} has no FP8 Tensor Cores (FP8 needs Hopper: h100-sxm, h200)")
            return self.peak_tflops_fp8
        raise ValueError(f"no peak FLOP/s for dtype {dtype!r} (known: bf16, fp16, fp32, fp8)")


FP8_NAMES = ("fp8", "float8", "float8_e4m3fn", "float8_e5m2", "e4m3", "e5m2")


HDR_GBIT = 200  # InfiniBand HDR line rate, Gb/s (DGX A100: one adapter per GPU)
NDR_GBIT = 400  # InfiniBand NDR line rate, Gb/s (DGX H100/H200: one ConnectX-7 per GPU)

_A100_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet "
    "(nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), spec table, SXM columns; "
    "NVIDIA Ampere architecture whitepaper (HBM2 1555 GB/s, NVLink 12 links / 600 GB/s); "
    "network: Narayanan et al. 2021 section 5 (DGX A100 on Selene: 8 x 200 Gb/s HDR HCAs "
    "per node for application traffic)"
)
_HOPPER_NVLINK_NET = (
    "NVLink: nvidia.com Hopper architecture page (NVLink 4: 900 GB/s bidirectional per GPU); "
    "network: docs.nvidia.com DGX BasePOD reference architecture, core components "
    "(DGX H100/H200: eight single-port ConnectX-7, up to 400 Gb/s InfiniBand)"
)

HARDWARE: dict[str, Hardware] = {
    "a100-40gb": Hardware(
        name="NVIDIA A100 SXM4 40 GB",
        peak_tflops_bf16=312.0,
        peak_tflops_fp16=312.0,
        peak_tflops_fp32=19.5,
        memory_gb=40.0,
        memory_bandwidth_gbs=1555.0,
        nvlink_gbs_per_direction=300.0,
        network_gbs_per_gpu=HDR_GBIT / 8,
        gpus_per_node=8,
        source=_A100_SOURCE,
        notes="HBM2. Sparse Tensor Core rates are twice the dense ones (624 for bf16/fp16). No FP8 "
              "Tensor Cores (Ampere's are 16-bit, TF32 and integer): --fp8 is refused.",
    ),
    "a100-80gb": Hardware(
        name="NVIDIA A100 SXM4 80 GB",
        peak_tflops_bf16=312.0,
        peak_tflops_fp16=312.0,
        peak_tflops_fp32=19.5,
        memory_gb=80.0,
        memory_bandwidth_gbs=2039.0,
        nvlink_gbs_per_direction=300.0,
        network_gbs_per_gpu=HDR_GBIT / 8,
        gpus_per_node=8,
        source=_A100_SOURCE,
        notes=(
            "HBM2e; same compute as the 40 GB part. The GPU of Narayanan et al. 2021 "
            "(whose 312 TFLOP/s peak is this bf16/fp16 figure). No FP8 Tensor Cores."
        ),
    ),
    "h100-sxm": Hardware(
        name="NVIDIA H100 SXM5 80 GB",
        peak_tflops_bf16=989.5,
        peak_tflops_fp16=989.5,
        peak_tflops_fp32=67.0,
        memory_gb=80.0,
        memory_bandwidth_gbs=3350.0,
        nvlink_gbs_per_direction=450.0,
        network_gbs_per_gpu=NDR_GBIT / 8,
        gpus_per_node=8,
        source=(
            "NVIDIA H100 product page / datasheet (nvidia.com/en-us/data-center/h100), "
            "H100 SXM column: bf16/fp16 Tensor Core 1,979 TFLOPS with sparsity (dense is "
            "half, per its footnote), FP32 67 TFLOPS, 80 GB, 3.35 TB/s, NVLink 900 GB/s; "
            + _HOPPER_NVLINK_NET
        ),
        notes=(
            "HBM3. Dense 16-bit peak computed from clocks is 989.4 TFLOP/s and fp32 66.9; "
            "the rounded datasheet figures are kept. FP8 Tensor Core: 3,958 TFLOPS with "
            "sparsity in the same H100 SXM column, so 1,979 dense (1,978.9 from clocks, twice "
            "the 16-bit rate: docs/planner-sources.md H5, H6)."
        ),
        peak_tflops_fp8=1979.0,
    ),
    "h200": Hardware(
        name="NVIDIA H200 SXM 141 GB",
        peak_tflops_bf16=989.5,
        peak_tflops_fp16=989.5,
        peak_tflops_fp32=67.0,
        memory_gb=141.0,
        memory_bandwidth_gbs=4800.0,
        nvlink_gbs_per_direction=450.0,
        network_gbs_per_gpu=NDR_GBIT / 8,
        gpus_per_node=8,
        source=(
            "NVIDIA H200 product page / datasheet (nvidia.com/en-us/data-center/h200), "
            "H200 SXM column: bf16/fp16 Tensor Core 1,979 TFLOPS with sparsity, FP32 67 "
            "TFLOPS, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s; DGX H200 total GPU memory "
            "1,128 GB (docs.nvidia.com DGX BasePOD); " + _HOPPER_NVLINK_NET
        ),
        notes=(
            "Same GH100 compute as the H100 SXM; more and faster memory (HBM3e). FP8 Tensor "
            "Core: 3,958 TFLOPS with sparsity in the H200 SXM column, 1,979 dense, the H100's "
            "(docs/planner-sources.md H9, H6)."
        ),
        peak_tflops_fp8=1979.0,
    ),
}

# the table's entry for a CUDA device's name (torch.cuda.get_device_name): the first tag it
# contains; an H100 PCIe or NVL part is not the SXM entry's (its clocks are lower), but is
# taken as it, as the bf16 MFU table of training/metrics.py takes it
DEVICE_TAGS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"))


def hardware_key(device_name: str) -> str | None:
    """The ``HARDWARE`` key of a CUDA device by its name, or None for an unlisted one."""
    return next((key for tag, key in DEVICE_TAGS if tag in device_name), None)


# --- "cpu" entry: calibrated at run time, not published ---------------------------------
# HARDWARE deliberately has no "cpu" key. A host CPU's matmul rate and memory bandwidth
# are not published figures; other code measures them at run time and builds
# Hardware(name="cpu", ..., source="calibrated on <host> at <time>") itself, then either
# inserts it as HARDWARE[CPU_KEY] or hands it straight to the planner. Nothing in this
# module does that calibration.
CPU_KEY = "cpu"
