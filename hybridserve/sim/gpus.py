"""GPU catalog for the cost model: peak dense FLOP/s, HBM capacity and bandwidth, link speed."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.errors import ConfigError

# Bytes per element of each supported dtype (weights, KV cache, activations).
# fp32 is what a model runs in on a CPU (`hybridserve calibrate --device cpu`).
DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5}


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    """One accelerator, datasheet values (no efficiency applied)."""

    name: str
    bf16_flops: float  # dense (no sparsity) BF16/FP16 tensor-core FLOP/s
    fp8_flops: float | None  # dense FP8 FLOP/s; None where the chip has no FP8 tensor cores
    fp4_flops: float | None  # dense FP4 FLOP/s; None where unsupported
    hbm_bytes: float  # HBM capacity, datasheet GB taken as 1e9 bytes
    hbm_bytes_per_s: float  # HBM bandwidth
    link_bytes_per_s: float  # GPU-to-GPU bandwidth per direction (half the bidirectional total)
    # Dense FP32 FLOP/s; None where not given (the catalog: serving GEMMs run in bf16 or below).
    # A calibrated device (a CPU) records its measured fp32 matmul rate here.
    fp32_flops: float | None = None
    # The memory the device reports to software (nvidia-smi, cudaMemGetInfo's total), which is
    # what a serving engine sizes its pool from; None where no report was found (the datasheet
    # capacity is used then).
    reported_bytes: float | None = None
    # The host link (host_link.py): bytes per second per direction between the GPU and its
    # host's memory, and the latency of one batched copy.
    host_link_bytes_per_s: float = 64 * 1e9
    host_link_latency_s: float = 10e-6
    # A calibrated device's measured weight-stream rates: bytes per second a one-row matmul
    # reads from an fp32 / bf16 weight matrix larger than the caches (what a decode step's
    # linear layers do). None in the catalog and in calibrations made before they were read.
    # Recorded, not used by the cost model: a pinned fit keeps `Efficiency.hbm` at it
    # (`calibration_fit.pinned_hbm`).
    fp32_stream_bytes_per_s: float | None = None
    bf16_stream_bytes_per_s: float | None = None

    def stream_bytes_per_s(self, dtype: str) -> float | None:
        """The measured weight-stream rate of `dtype`'s matmuls, or None if not measured."""
        if dtype == "fp32":
            return self.fp32_stream_bytes_per_s
        if dtype in ("bf16", "fp16"):
            return self.bf16_stream_bytes_per_s
        return None

    @property
    def memory_bytes(self) -> float:
        """Bytes a serving engine sees as the device's total: the reported figure, else HBM."""
        return self.reported_bytes if self.reported_bytes is not None else self.hbm_bytes

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for GEMMs whose inputs are `dtype`. Raises ConfigError if none."""
        if dtype in ("bf16", "fp16"):
            return self.bf16_flops
        table = {"fp8": self.fp8_flops, "fp4": self.fp4_flops, "fp32": self.fp32_flops}
        if dtype not in table:
            raise ConfigError("dtype", dtype, f"use one of {sorted(DTYPE_BYTES)}")
        peak = table[dtype]
        if peak is None:
            if dtype == "fp32":
                raise ConfigError(
                    "dtype", dtype, f"{self.name} has no fp32 peak in its spec; use bf16"
                )
            raise ConfigError("dtype", dtype, f"{self.name} has no {dtype} tensor cores; use bf16")
        return peak


_T = 1e12
_G = 1e9
_GIB = float(1 << 30)

# Sources: data/gpu-datasheets.json, which quotes (dense values, no sparsity):
# - A100-SXM4 80GB: glennklockwood.com/garden/processors/A100 citing the NVIDIA A100 datasheet
#   (BF16 312 TFLOP/s, 80 GB HBM2e, 2.039 TB/s); NVLink 3 600 GB/s bidirectional (denvrdata KB,
#   fudzilla); no FP8 on Ampere (TransformerEngine support matrix).
# - H100-SXM5 80GB: glennklockwood.com h100 page citing the NVIDIA H100 datasheet (BF16 989.4,
#   FP8 1978.9 = half the 3,958 sparse figure, 80 GB HBM3, 3.35 TB/s, NVLink 4 900 GB/s).
# - H200-SXM 141GB: TensorRT-LLM docs/source/blogs/H200launch.md (4.8 TB/s, 141 GB) and the
#   MLPerf v4.1 NVIDIA H200 system JSON (NVLink 900 GB/s); compute equals H100 (same GH100 die).
# - B200 (HGX, 1000 W): glennklockwood.com B200 page (BF16 2250, FP8 4500, FP4 9000) and the
#   NVIDIA HGX B200 spec table (180 GB HBM3e, 7.7 TB/s; other sources say 8 TB/s), NVLink 5
#   1.8 TB/s.
# - MI300X 192GB: alpharomercoma/MI300X-vs-H200 METHODOLOGY.md (BF16 1307.4, FP8 2614.9,
#   5.3 TB/s, 192 GB); Infinity Fabric 7 x 128 GB/s = 896 GB/s aggregate (gpu.blog MI300X page).
# Reported memory: the total CUDA gives software (cudaMemGetInfo, torch.cuda.mem_get_info), which
# vLLM logs as "total_gpu_memory" and sizes its pool from; below the datasheet's GB (the driver
# keeps some) and below nvidia-smi's total (143,771 MiB = 140.40 GiB on an H200 SXM).
# - H200: 139.81 GiB, a vLLM memory-profiling log on an H200 ("the current vLLM instance can use
#   total_gpu_memory (139.81GiB) x gpu_memory_utilization (0.85) = 118.84GiB"); PyTorch's
#   out-of-memory messages on H200s say "a total capacity of 139.80 GiB" / "139.81 GiB".
# - H100-SXM: 79.18 GiB, vLLM's total in llm-d-benchmark's
#   config_explorer/empirical-vllm-memory-results.md ("H100 GPUs (79.18 GiB total memory)").
# - A100-80G, B200, MI300X: no report found; the datasheet capacity stands in.
# Host link, per direction (the host tier's copies): PCIe Gen5 x16 is 128 GB/s bidirectional,
# 64 GB/s each way, on H100 SXM, H200 SXM (the MLPerf v4.1 H200-SXM-141GBx8 system JSON lists
# "PCIe Gen5 x16"), HGX B200 and MI300X; PCIe Gen4 x16 (32 GB/s each way) on A100. Measured
# pinned-memory copies reach about 50 GB/s of the 64 on an H100 (vLLM blog, "KV offloading
# connector", 2026-01-08: "up to about 50GB/s" one way, 83.4 GB/s both ways): the host link's
# efficiency (host_link.py) is that ratio. Latency: about 5-7 us per cudaMemcpyAsync call for
# small chunks (DualPath, arXiv 2602.21548, section 5.2); 10 us is charged per batched copy.
# GH200 (96 GB HBM3 at 3 TB/s, the NVIDIA "Grace Hopper Superchip Architecture In-Depth" blog):
# NVLink-C2C, 900 GB/s total, 450 GB/s each way, to up to 512 GB of LPDDR5X; compute as H100.
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu(
            name="A100-80G",
            bf16_flops=312 * _T,
            fp8_flops=None,
            fp4_flops=None,
            hbm_bytes=80 * _G,
            hbm_bytes_per_s=2.039 * _T,
            link_bytes_per_s=300 * _G,
            host_link_bytes_per_s=32 * _G,
        ),
        Gpu(
            name="H100-SXM",
            bf16_flops=989.4 * _T,
            fp8_flops=1978.9 * _T,
            fp4_flops=None,
            hbm_bytes=80 * _G,
            hbm_bytes_per_s=3.35 * _T,
            link_bytes_per_s=450 * _G,
            reported_bytes=79.18 * _GIB,
        ),
        Gpu(
            name="H200",
            bf16_flops=989.4 * _T,
            fp8_flops=1978.9 * _T,
            fp4_flops=None,
            hbm_bytes=141 * _G,
            hbm_bytes_per_s=4.8 * _T,
            link_bytes_per_s=450 * _G,
            reported_bytes=139.81 * _GIB,
        ),
        Gpu(
            name="B200",
            bf16_flops=2250 * _T,
            fp8_flops=4500 * _T,
            fp4_flops=9000 * _T,
            hbm_bytes=180 * _G,
            hbm_bytes_per_s=7.7 * _T,
            link_bytes_per_s=900 * _G,
        ),
        Gpu(
            name="GH200",
            bf16_flops=989.4 * _T,
            fp8_flops=1978.9 * _T,
            fp4_flops=None,
            hbm_bytes=96 * _G,
            hbm_bytes_per_s=3.0 * _T,
            link_bytes_per_s=450 * _G,
            host_link_bytes_per_s=450 * _G,
        ),
        Gpu(
            name="MI300X",
            bf16_flops=1307.4 * _T,
            fp8_flops=2614.9 * _T,
            fp4_flops=None,
            hbm_bytes=192 * _G,
            hbm_bytes_per_s=5.3 * _T,
            link_bytes_per_s=448 * _G,
        ),
    )
}


def get_gpu(name: str) -> Gpu:
    """The catalog entry for `name`. Raises ConfigError naming the known GPUs."""
    try:
        return GPUS[name]
    except KeyError:
        raise ConfigError("gpu", name, f"use one of {sorted(GPUS)}") from None


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of `dtype`. Raises ConfigError for an unknown dtype."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError("dtype", dtype, f"use one of {sorted(DTYPE_BYTES)}") from None
