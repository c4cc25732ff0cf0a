"""GPU and interconnect catalog: published peak numbers plus one efficiency profile per GPU
(tetrad.hardware.efficiency).

Peak FLOP/s are the vendors' *dense* tensor-core figures (never the 2:4-sparsity ones); bandwidths
are per GPU and per direction. Sources are the vendor datasheets and architecture whitepapers named
next to each entry. Memory sizes are the marketed "GB", which NVIDIA means as GiB (an A100-80GB
reports 81920 MiB).

The efficiency profile (how close real kernels get to those peaks) is calibrated once per
architecture against published training runs (benchmarks/planner_cross_validation.py), never per
question; a GPU without published runs takes its architecture's sibling's, as said by the entry.
A machine `tetrad calibrate` measured is a GPU of the same schema, read from a JSON profile
(load_profile; `--gpu` and `--hardware` take a catalog name or a profile file).
No torch here: the planner runs on a laptop.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from tetrad.hardware.efficiency import EfficiencyProfile
from tetrad.errors import ConfigError

GiB = 2**30
GB = 1e9
TERA = 1e12


# Calibrated profiles: benchmarks/planner_cross_validation.py fits the matmul and attention
# fractions on the published runs of benchmarks/published_runs.py (source-balanced mean error,
# grids limited to measured ranges) and reports the leave-one-source-out error in
# docs/planner.md; everything else here is fixed from papers and datasheets. Ampere: Megatron-LM's
# A100 runs (Narayanan et al. 2021, Korthikanti et al. 2022), MT-NLG, BLOOM, torchtitan and
# MosaicML's FSDP runs. Its vendor attention is not fitted (no Megatron run of the time used
# flash attention): FlashAttention-2's paper measures 50-73% of peak for forward + backward on
# A100; 0.6 is used.
# An overlapped collective runs one NCCL block per channel on an SM the GEMMs lack: 24 for an H100
# all-gather in an Nsight trace (NVIDIA forums, "Compute-Communication Overlap Causes Severe GEMM
# Performance Degradation because of Tail Effect"). Not fitted.
NCCL_SMS = 24
AMPERE = EfficiencyProfile(matmul=0.69, attention=0.6, memory=0.75, kernel_overhead_s=2e-6,
                           intra_link=0.85, inter_link=0.9, intra_latency_s=8e-6,
                           inter_latency_s=20e-6, portable_attention=0.62,
                           comm_interference=NCCL_SMS / 108)
# Hopper: NVIDIA's DGX-Cloud recipes (NeMo 24.09 on DGX H100, BF16 and FP8), Megatron-Bridge's FP8
# rows, Llama 3's 8K-16K-GPU runs and MosaicML's single-node H100 runs. Sustained matmul
# efficiency is lower than on Ampere: at scale the 700 W H100 runs GEMMs near 600 TFLOP/s, not the
# 800 of a cool, short benchmark; fp8 GEMMs reach a still smaller share of their doubled peak.
# Attention is measured, not fitted: the causal forward of 32K-64K-token calls on one H200 (the
# H100's SMs and clocks), cuDNN 0.62 and FlashAttention-2 0.34 of peak
# (benchmarks/gpu_attention_efficiency.py); compute.ATTENTION_LENGTH_CURVE adds the backward's
# and short calls' smaller shares. An attention level (both architectures) is that forward's.
HOPPER = EfficiencyProfile(matmul=0.60, attention=0.62, memory=0.85, kernel_overhead_s=6e-6,
                           intra_link=0.7, inter_link=0.9, intra_latency_s=8e-6,
                           inter_latency_s=20e-6, portable_attention=0.34, fp8_matmul=0.54,
                           comm_interference=NCCL_SMS / 132)
# No published large-scale runs exist for these; each takes the profile of its nearest calibrated
# architecture (Ada and GA102 -> Ampere's, whose tensor cores they share; Blackwell -> Hopper's).
ADA = AMPERE
BLACKWELL = HOPPER


@dataclass(frozen=True)
class GPU:
    """Datasheet numbers of one GPU and the platform it usually ships in."""

    name: str
    # Dense FLOP/s by compute dtype (fp32, bf16, fp16, fp8, int8); left out of the hash so GPUs
    # can key the planner's caches.
    peak_flops: dict[str, float] = field(hash=False)
    memory_bytes: float
    memory_bandwidth: float  # HBM/GDDR bytes per second
    nvlink_bandwidth: float  # per direction, 0 if the GPU has no NVLink switch fabric
    pcie_bandwidth: float  # per direction, the GPU's own host link
    nic_bandwidth: float  # per GPU per direction in its reference server; 0 if none published
    host_memory_bandwidth: float  # CPU DRAM bandwidth per GPU in the reference server
    efficiency: EfficiencyProfile
    source: str = ""
    aliases: tuple[str, ...] = field(default=())
    # On-demand dollars per GPU-hour (PRICES below; --price-per-gpu-hour or the inline spec's
    # price= replaces it); 0 means none is known.
    price_per_hour: float = 0.0

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype`; formats the tensor cores lack run as bf16/fp16
        (weight-only quantization dequantizes into a 16-bit GEMM)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("bf16", self.peak_flops["fp16"])

    @property
    def intra_node_bandwidth(self) -> float:
        return self.nvlink_bandwidth or self.pcie_bandwidth


def _tflops(**values: float) -> dict[str, float]:
    return {dtype: tflops * TERA for dtype, tflops in values.items()}


# PCIe per direction: Gen4 x16 32 GB/s, Gen5 x16 64 GB/s (PCI-SIG).
PCIE4 = 32 * GB
PCIE5 = 64 * GB
# Reference-server NICs, per GPU: DGX A100 has 8x 200 Gb/s HDR, DGX H100/B200 8x 400 Gb/s NDR.
HDR_200G = 25 * GB
NDR_400G = 50 * GB
# Host DRAM per GPU in the DGX: A100 = 2x EPYC 7742, 8 channels DDR4-3200 each (2x 204.8 GB/s);
# H100 = 2x Xeon 8480C, 8 channels DDR5-4800 each (2x 307.2 GB/s); divided by 8 GPUs.
DGX_A100_HOST = 2 * 204.8 * GB / 8
DGX_H100_HOST = 2 * 307.2 * GB / 8
# A desktop with dual-channel DDR5-5600 (89.6 GB/s) for the consumer cards.
DESKTOP_HOST = 89.6 * GB

GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in [
    # NVIDIA A100 datasheet (2021): BF16/FP16 312 TF dense, INT8 624 TOPS, FP32 19.5 TF;
    # NVLink 3 600 GB/s bidirectional; 40GB: HBM2 1555 GB/s; 80GB: HBM2e 2039 GB/s.
    GPU("a100-40gb", _tflops(fp32=19.5, bf16=312, fp16=312, int8=624), 40 * GiB, 1555 * GB,
        300 * GB, PCIE4, HDR_200G, DGX_A100_HOST, AMPERE, "NVIDIA A100 datasheet",
        aliases=("a100-sxm-40gb",)),
    GPU("a100-80gb", _tflops(fp32=19.5, bf16=312, fp16=312, int8=624), 80 * GiB, 2039 * GB,
        300 * GB, PCIE4, HDR_200G, DGX_A100_HOST, AMPERE, "NVIDIA A100 datasheet",
        aliases=("a100", "a100-sxm", "a100-sxm-80gb")),
    # NVIDIA H100 datasheet: SXM BF16 989.4 TF dense, FP8 1978.9 TF, INT8 1978.9 TOPS,
    # FP32 67 TF; HBM3 80 GB 3.35 TB/s; NVLink 4 900 GB/s bidirectional; PCIe Gen5.
    GPU("h100-sxm", _tflops(fp32=67, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
        80 * GiB, 3350 * GB, 450 * GB, PCIE5, NDR_400G, DGX_H100_HOST, HOPPER,
        "NVIDIA H100 datasheet", aliases=("h100", "h100-80gb", "h100-sxm5")),
    # H100 PCIe: BF16 756 TF dense, FP8 1513 TF, FP32 51 TF; HBM2e 80 GB 2.0 TB/s; no NVSwitch
    # (the 600 GB/s NVLink bridge joins pairs only), so GPUs talk over PCIe Gen5.
    GPU("h100-pcie", _tflops(fp32=51, bf16=756, fp16=756, fp8=1513, int8=1513), 80 * GiB,
        2000 * GB, 0.0, PCIE5, NDR_400G, DGX_H100_HOST, HOPPER, "NVIDIA H100 datasheet"),
    # NVIDIA H200 datasheet: H100 SXM compute, HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s.
    GPU("h200", _tflops(fp32=67, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9), 141 * GiB,
        4800 * GB, 450 * GB, PCIE5, NDR_400G, DGX_H100_HOST, HOPPER, "NVIDIA H200 datasheet",
        aliases=("h200-sxm",)),
    # H800 SXM (China export H100): H100 SXM compute and HBM3, NVLink cut to 400 GB/s
    # bidirectional (DeepSeek-V3 technical report, section 3.1).
    GPU("h800", _tflops(fp32=67, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9), 80 * GiB,
        3350 * GB, 200 * GB, PCIE5, NDR_400G, DGX_H100_HOST, HOPPER,
        "NVIDIA H800 product brief; DeepSeek-V3 report", aliases=("h800-sxm",)),
    # H20 product brief: BF16 148 TF, FP8 296 TF, INT8 296 TOPS, FP32 44 TF; HBM3 96 GB
    # 4.0 TB/s; NVLink 900 GB/s.
    GPU("h20", _tflops(fp32=44, bf16=148, fp16=148, fp8=296, int8=296), 96 * GiB, 4000 * GB,
        450 * GB, PCIE5, NDR_400G, DGX_H100_HOST, HOPPER, "NVIDIA H20 product brief"),
    # DGX B200 datasheet: per GPU 180 GB HBM3e at 8 TB/s (1440 GB and 64 TB/s per 8); HGX B200
    # dense BF16 2.25 PF, FP8 4.5 PF, INT8 4.5 POPS, FP32 75 TF; NVLink 5 1.8 TB/s bidirectional;
    # 8x 400 Gb/s ConnectX-7. Host: 2x Xeon 8570, 8 channels DDR5-5600 (2x 358.4 GB/s).
    GPU("b200", _tflops(fp32=75, bf16=2250, fp16=2250, fp8=4500, int8=4500), 180 * GiB,
        8000 * GB, 900 * GB, PCIE5, NDR_400G, 2 * 358.4 * GB / 8, BLACKWELL,
        "NVIDIA DGX B200 / HGX B200 datasheets"),
    # L40S datasheet: BF16 362.05 TF dense, FP8 733 TF, INT8 733 TOPS, FP32 91.6 TF; GDDR6 48 GB
    # 864 GB/s; PCIe Gen4, no NVLink. No reference multi-node platform is published.
    GPU("l40s", _tflops(fp32=91.6, bf16=362.05, fp16=362.05, fp8=733, int8=733), 48 * GiB,
        864 * GB, 0.0, PCIE4, 0.0, DESKTOP_HOST, ADA, "NVIDIA L40S datasheet"),
    # Ada whitepaper (RTX 4090): FP16/BF16 tensor with FP32 accumulate 165.2 TF dense, FP8 330.3,
    # INT8 660.6 TOPS, FP32 82.6 TF; GDDR6X 24 GB 1008 GB/s; PCIe Gen4, no NVLink.
    GPU("rtx-4090", _tflops(fp32=82.6, bf16=165.2, fp16=165.2, fp8=330.3, int8=660.6),
        24 * GiB, 1008 * GB, 0.0, PCIE4, 0.0, DESKTOP_HOST, ADA,
        "NVIDIA Ada GPU architecture whitepaper", aliases=("4090",)),
    # Ampere GA102 whitepaper (RTX 3090): FP16/BF16 tensor with FP32 accumulate 71 TF dense,
    # INT8 284 TOPS, FP32 35.6 TF; GDDR6X 24 GB 936 GB/s; NVLink bridge 112.5 GB/s bidirectional
    # joins two cards only, so the planner uses PCIe Gen4 between GPUs.
    GPU("rtx-3090", _tflops(fp32=35.6, bf16=71, fp16=71, int8=284), 24 * GiB, 936 * GB, 0.0,
        PCIE4, 0.0, DESKTOP_HOST, AMPERE, "NVIDIA Ampere GA102 whitepaper", aliases=("3090",)),
]}


# On-demand list prices, dollars per GPU-hour, one vendor where it lists the GPU so that GPUs
# compare at one provider's margins. RunPod Serverless "flex" per-second rates x 3600
# (docs.runpod.io/serverless/pricing, as stored in November 2026): 4090 PRO $0.00031/s, 3090
# $0.00019/s, L40S $0.00053/s, A100 80 GB $0.00076/s, H100 PRO $0.00116/s, H200 PRO $0.00155/s,
# B200 $0.00240/s. Lambda's on-demand list as a price survey read it on 2026-05-07
# (techbytes.app, "Serverless GPU Pricing Matrix [2026]"): 1x A100 40 GB $1.48, 1x H100 PCIe
# $2.86. H800: the $2 per GPU-hour rental DeepSeek-V3's
# technical report prices its run at (table 1). The H20 has no public on-demand list price:
# pass --price-per-gpu-hour.
PRICES = {"rtx-4090": 0.00031 * 3600, "rtx-3090": 0.00019 * 3600, "l40s": 0.00053 * 3600,
          "a100-80gb": 0.00076 * 3600, "h100-sxm": 0.00116 * 3600, "h200": 0.00155 * 3600,
          "b200": 0.00240 * 3600, "a100-40gb": 1.48, "h100-pcie": 2.86, "h800": 2.0}
GPUS = {name: dataclasses.replace(entry, price_per_hour=PRICES.get(name, 0.0))
        for name, entry in GPUS.items()}


def _lookup_table() -> dict[str, GPU]:
    table = {}
    for gpu in GPUS.values():
        for key in (gpu.name, *gpu.aliases):
            table[key] = gpu
    return table


def gpu(name: str) -> GPU:
    """Look a GPU up by name or alias, case-insensitively; unknown names list close matches."""
    table = _lookup_table()
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in table:
        return table[key]
    close = difflib.get_close_matches(key, list(table), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(GPUS)}"
    raise ConfigError(f"unknown GPU {name!r} ({hint})")


def gpu_from_device_name(device_name: str) -> GPU | None:
    """The catalog GPU a CUDA device name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
    "NVIDIA GeForce RTX 4090") is, or None: the catalog key all of whose parts appear in the
    name, the most specific one when several do."""
    words = set(device_name.lower().replace("-", " ").replace("_", " ").split())
    matches = [(len(key.split("-")), key) for key in _lookup_table()
               if set(key.split("-")) <= words]
    return _lookup_table()[max(matches)[1]] if matches else None


# The largest cluster the planner is meant for: 1,048,576 GPUs, five times the largest built
# (about 200,000 in 2025); past it a count is a typo, and the search would only take longer.
MAX_GPUS = 2**20


@dataclass(frozen=True)
class Cluster:
    """`num_gpus` GPUs of one kind in nodes of `gpus_per_node`, NVLink/PCIe inside a node and one
    NIC per GPU between nodes (rail-optimized, as in NVIDIA's DGX SuperPOD)."""

    gpu: GPU
    num_gpus: int
    gpus_per_node: int = 8
    nic_bandwidth: float = 0.0  # 0 means the GPU's reference-server NIC

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ConfigError(f"--num-gpus must be at least 1, got {self.num_gpus}")
        if self.num_gpus > MAX_GPUS:
            raise ConfigError(f"--num-gpus {self.num_gpus} is more than {MAX_GPUS:,}, the "
                              f"largest cluster the planner is meant for")
        if self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ConfigError(
                f"{self.num_gpus} GPUs do not fill whole nodes of {self.gpus_per_node}: "
                f"use a multiple of {self.gpus_per_node} or change --gpus-per-node")
        if self.nic_bandwidth == 0.0:
            object.__setattr__(self, "nic_bandwidth", self.gpu.nic_bandwidth)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @property
    def node_size(self) -> int:
        """GPUs that share the intra-node fabric."""
        return min(self.gpus_per_node, self.num_gpus)

    @property
    def intra_bandwidth(self) -> float:
        return self.gpu.intra_node_bandwidth

    @property
    def inter_bandwidth(self) -> float:
        if self.num_nodes > 1 and self.nic_bandwidth == 0.0:
            raise ConfigError(
                f"{self.gpu.name} has no published multi-node network: pass --nic-gbps with the "
                f"per-GPU network bandwidth (Gb/s), or use at most {self.gpus_per_node} GPUs")
        return self.nic_bandwidth

    def replace(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)
