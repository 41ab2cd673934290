"""The machine as the cost model sees it: peak FLOP/s by dtype, memory bandwidth and
capacity, the two links a collective can use, and the efficiencies a GEMM reaches.

Published figures (hardware.py: datasheet numbers with their sources) become a
:class:`Machine` here, with the assumptions the cost model adds to them, named:

* ``gemm_efficiency``: the fraction of the dense peak a large GEMM reaches (cuBLAS on
  A100 and H100 runs large bf16 GEMMs at roughly 70-85% of the datasheet peak);
* ``gemm_half``: the smallest GEMM dimension at which a GEMM runs at half of that
  (tile and wave quantisation: a 128-wide tile on a 64-wide matrix is half empty);
* ``kernel_s``: the launch cost of one kernel;
* link latencies (NVLink a few microseconds, InfiniBand about ten, per ring step);
* ``usable_fraction``: the share of device memory a run can fill (the CUDA context,
  NCCL's buffers and the allocator's fragmentation take the rest).

The ``cpu`` machine is measured on the host instead (profile.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one GPU sends (per direction)
    latency: float  # seconds per ring step


@dataclass(frozen=True)
class Machine:
    name: str
    peak: dict[str, float]  # FLOP/s by dtype (dense)
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes per device
    nvlink: Link  # inside a node
    network: Link  # between nodes, per GPU
    gpus_per_node: int
    gemm_efficiency: float = 0.8
    gemm_half: float = 64.0
    kernel_s: float = 4e-6
    usable_fraction: float = 0.92
    source: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> float:
        return self.peak.get(dtype) or self.peak["fp32"]

    def link(self, span: int, node: int | None = None) -> Link:
        """The link of a group whose ranks lie within ``span`` consecutive ranks: NVLink
        when that fits a node, else each GPU's network link."""
        return self.nvlink if span <= (node or self.gpus_per_node) else self.network

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory * self.usable_fraction


def _gpu(name: str, bf16: float, fp32: float, hbm: float, memory: float, nvlink: float, network: float,
         source: str) -> Machine:
    return Machine(name=name, peak={"bf16": bf16 * 1e12, "fp16": bf16 * 1e12, "fp32": fp32 * 1e12,
                                    "fp64": fp32 / 2 * 1e12},
                   memory_bandwidth=hbm * GB, memory=memory * GB, nvlink=Link(nvlink * GB, 5e-6),
                   network=Link(network * GB, 1e-5), gpus_per_node=8, source=source)


# dense tensor-core peak (TFLOP/s), fp32 without tensor cores, HBM GB/s, memory GB,
# NVLink GB/s per direction, network GB/s per GPU (one HDR 200 Gb/s or NDR 400 Gb/s NIC)
MACHINES: dict[str, Machine] = {
    "a100-40gb": _gpu("a100-40gb", 312, 19.5, 1555, 40, 300, 25, "NVIDIA A100 datasheet; DGX A100 (HDR 200 Gb/s per GPU)"),
    "a100-80gb": _gpu("a100-80gb", 312, 19.5, 2039, 80, 300, 25, "NVIDIA A100 datasheet; DGX A100 (HDR 200 Gb/s per GPU)"),
    "h100-sxm": _gpu("h100-sxm", 989, 67, 3350, 80, 450, 50, "NVIDIA H100 datasheet; DGX H100 (NDR 400 Gb/s per GPU)"),
    "h200": _gpu("h200", 989, 67, 4800, 141, 450, 50, "NVIDIA H200 datasheet; DGX H200 (NDR 400 Gb/s per GPU)"),
}


def machine(name: str) -> Machine:
    """A machine by name; ``cpu`` is profiled on this host (a few seconds, then cached)."""
    if name == "cpu":
        from gridtrain.planner.profile import cpu_machine

        return cpu_machine()
    if name not in MACHINES:
        raise ValueError(f"--hardware {name!r} is not one of {', '.join([*MACHINES, 'cpu'])}")
    return MACHINES[name]
