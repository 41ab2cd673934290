"""The machine as the cost model sees it: peak FLOP/s by dtype, memory bandwidth and
capacity, the two links a collective can use, and the efficiencies a GEMM reaches.

Published figures (hardware.py: datasheet numbers with their sources) become a
:class:`Machine` here, with the assumptions the cost model adds to them, named:

* ``gemm_efficiency``: the fraction of the dense peak a large GEMM reaches in a training
  step (``GEMM_EFFICIENCY``: cuBLAS runs large bf16 GEMMs at about 80% of the A100's
  datasheet peak and about 70% of the H100's, whose clocks a sustained load holds below
  the boost the peak is quoted at; the Hopper figure is fit on the published runs of
  benchmarks/calibration_rows.py, docs/planner.md);
* ``gemm_half``: the smallest GEMM dimension at which a GEMM runs at half of that
  (tile and wave quantisation: a 128-wide tile on a 64-wide matrix is half empty);
* ``kernel_s``: the launch cost of one kernel;
* link latencies (NVLink a few microseconds, InfiniBand about ten, per ring step);
* ``usable_fraction``: the share of device memory a run can fill (the CUDA context,
  NCCL's buffers and the allocator's fragmentation take the rest).

``peak["fp8"]`` is there only where the GPU has FP8 Tensor Cores (Hopper), and its GEMMs
reach the same ``gemm_efficiency`` of it as bf16's of theirs (an assumption: no FP8 run
has calibrated it); the ``cpu`` machine's is its fp32 rate, as float8 GEMMs are emulated
on a CPU by dequantised fp32 products (parallel/float8.py).

The ``cpu`` machine is measured on the host instead (profile.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from gridtrain.planner.hardware import HARDWARE, Hardware

GB = 1e9


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes/s one GPU sends, per direction) and latency (seconds per
    ring step). ``measured`` overrides both for some kinds of operation, as
    ``(kind, latency, bandwidth)``: the ``cpu`` machine's gloo, whose all-gather,
    reduce-scatter and sends run at rates of their own (profile.py)."""

    bandwidth: float
    latency: float
    measured: tuple[tuple[str, float, float], ...] = ()

    def rates(self, kind: str) -> tuple[float, float]:
        """(latency, bandwidth) of one kind of operation over this link."""
        for k, latency, bandwidth in self.measured:
            if k == kind:
                return latency, bandwidth
        return self.latency, self.bandwidth

    def collective(self, nbytes: float, n: int, kind: str = "all_reduce") -> float:
        """A ring collective over ``n`` ranks of this link (:func:`ring_seconds`)."""
        latency, bandwidth = self.rates(kind)
        return ring_seconds(nbytes, n, bandwidth, latency, kind)

    def send(self, nbytes: float) -> float:
        """One point-to-point message of ``nbytes``."""
        latency, bandwidth = self.rates("send")
        return nbytes / bandwidth + latency


def ring_seconds(nbytes: float, n: int, bandwidth: float, latency: float, kind: str = "all_reduce") -> float:
    """A ring collective of ``nbytes`` (the whole tensor) over ``n`` ranks: an all-reduce
    sends 2 (n-1)/n of it per rank, an all-gather or reduce-scatter (n-1)/n."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps / n * nbytes / bandwidth + steps * latency


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
    fp8_emulated: bool = False  # float8 GEMMs as fp32 GEMMs of dequantised operands (the CPU)

    def peak_flops(self, dtype: str) -> float:
        return self.peak.get(dtype) or self.peak["fp32"]

    def link(self, span: int, node: int | None = None) -> Link:
        """The link of a group whose ranks lie within ``span`` consecutive ranks: NVLink
        when that fits a node, else each GPU's network link."""
        return self.nvlink if span <= (node or self.gpus_per_node) else self.network

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory * self.usable_fraction


GEMM_EFFICIENCY = {"a100-40gb": 0.8, "a100-80gb": 0.8, "h100-sxm": 0.7, "h200": 0.7}


def from_hardware(key: str, hw: Hardware) -> Machine:
    """The cost model's view of published figures (hardware.py), with this module's
    assumptions (efficiency, launch cost, latencies, usable memory)."""
    fp8 = {"fp8": hw.peak_tflops_fp8 * 1e12} if hw.peak_tflops_fp8 else {}
    return Machine(name=key, gemm_efficiency=GEMM_EFFICIENCY.get(key, 0.8),
                   peak={"bf16": hw.peak_tflops_bf16 * 1e12, "fp16": hw.peak_tflops_fp16 * 1e12,
                         "fp32": hw.peak_tflops_fp32 * 1e12, **fp8},
                   memory_bandwidth=hw.memory_bandwidth_gbs * GB, memory=hw.memory_gb * GB,
                   nvlink=Link(hw.nvlink_gbs_per_direction * GB, NVLINK_LATENCY_S),
                   network=Link(hw.network_gbs_per_gpu * GB, NETWORK_LATENCY_S), gpus_per_node=hw.gpus_per_node,
                   source=hw.source)


NVLINK_LATENCY_S = 5e-6
NETWORK_LATENCY_S = 1e-5
MACHINES: dict[str, Machine] = {key: from_hardware(key, hw) for key, hw in HARDWARE.items()}


def machine(name: str, gpus: int = 1) -> Machine:
    """A machine by name; ``cpu`` is profiled on this host (a few seconds, then cached),
    one "GPU" being one of ``gpus`` local worker processes."""
    if name == "cpu":
        return cpu_machine(gpus)
    if name not in MACHINES:
        raise ValueError(f"--hardware {name!r} is not one of {', '.join([*MACHINES, 'cpu'])}")
    return MACHINES[name]


def machine_from_profile(profile: dict, world: int) -> Machine:
    """The ``cpu`` machine: one worker's share of the host profiled by profile.py, for a
    job of ``world`` local workers (profile.py's docstring says how)."""
    cores = profile["cores"]
    threads = max(1, cores // max(world, 1))
    share = threads * min(1.0, cores / max(world, 1))
    flops = {int(k): v for k, v in profile["gemm_flops"].items()}
    peak = max(flops.values())
    # x / (x + h) = f(x) / peak  =>  h = x (peak / f(x) - 1), over the sizes below the peak's
    halves = [n * (peak / f - 1) for n, f in flops.items() if f < peak]
    half = statistics.median(halves) if halves else 1.0
    # more workers than cores: the copies through the loopback share the cores too
    crowd = max(1.0, world / cores)
    kinds = tuple((k, lat, bw / crowd) for k, (lat, bw) in sorted(profile["link"].items()))
    latency, bandwidth = profile["link"]["all_reduce"]
    link = Link(bandwidth / crowd, latency, kinds)
    return Machine(name="cpu", peak={"fp32": peak * share, "fp64": peak * share / 2, "bf16": peak * share / 4,
                                     "fp16": peak * share / 8, "fp8": peak * share},  # fp8: emulated in fp32
                   fp8_emulated=True,                   memory_bandwidth=profile["bandwidth"] * share, memory=_host_memory(), nvlink=link, network=link,
                   gpus_per_node=max(world, 1), gemm_efficiency=1.0, gemm_half=half, kernel_s=profile["kernel_s"],
                   usable_fraction=0.8, source=f"measured on this host ({cores} cores)")


def _host_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9


def cpu_machine(world: int = 1, refresh: bool = False) -> Machine:
    from gridtrain.planner.profile import host_profile

    return machine_from_profile(host_profile(refresh), world)
