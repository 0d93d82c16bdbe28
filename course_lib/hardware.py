"""Real GPUs in numbers: compute units, on-chip memory, off-chip memory, peak throughput.

Introduced in notebooks/02_gpu_memory.ipynb; used by the roofline (``course_lib.roofline``),
the tile-size sweep of notebooks/03_tiled_matmul.ipynb and the decoding lessons.

Every row of ``GPUS`` is copied from NVIDIA's own documents, named in its ``source`` field:

* the product datasheets (memory size and bandwidth, peak tensor-core and FP32 throughput);
* the architecture whitepapers (SM count of the shipped part, L2 size);
* the CUDA C++ Programming Guide, table "Technical Specifications per Compute Capability"
  (shared memory per SM and per block: 164/163 KiB on sm_80, 100/99 KiB on sm_89,
  228/227 KiB on sm_90).

Conventions:

* ``fp16_tensor_tflops`` is the *dense* FP16/BF16 tensor-core peak with FP32 accumulation, the
  mode every kernel of the course uses. Datasheets often print the "with sparsity" figure,
  which is twice as large; GeForce cards (the RTX 4090) run FP32 accumulation at half the
  FP16-accumulate rate, and the table holds the FP32-accumulate number.
* ``fp32_tflops`` is the non-tensor (CUDA-core) FP32 peak: what softmax, exp and rescaling run on.
* ``hbm_tbs`` is in 10¹² bytes per second, as datasheets print it. ``hbm_gib`` is the
  datasheet's memory size (NVIDIA's "80 GB" is 80 GiB of DRAM; the H200's "141 GB" is the
  datasheet figure, and the driver shows about 140 GiB of it).
* ``smem_per_sm_kib`` is the most shared memory one SM can give its resident blocks (the rest
  of the unified L1/shared array stays L1); ``smem_per_block_kib`` the most one block may opt in to.

``current_gpu()`` reads the live device through ``torch.cuda.get_device_properties``. A GPU it
recognises gets the table's throughput figures with the live SM count, memory and cache sizes;
an unknown one gets ``None`` for the figures no driver reports (bandwidth, peak FLOP/s).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

_A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-"
                   "1758950-r4-web.pdf), https://www.nvidia.com/en-us/data-center/a100/")
_AMPERE_WP = ("NVIDIA A100 Tensor Core GPU Architecture whitepaper (v1.0, 2020), "
              "https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/"
              "nvidia-ampere-architecture-whitepaper.pdf")
_H100_DATASHEET = ("NVIDIA H100 Tensor Core GPU datasheet, "
                   "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_HOPPER_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), "
              "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper")
_H200_DATASHEET = ("NVIDIA H200 Tensor Core GPU datasheet, "
                   "https://www.nvidia.com/en-us/data-center/h200/")
_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper (v2.1), https://images.nvidia.com/aem-dam/"
           "Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
_L4_DATASHEET = ("NVIDIA L4 Tensor Core GPU datasheet, "
                 "https://www.nvidia.com/en-us/data-center/l4/")
_CUDA_GUIDE = ("CUDA C++ Programming Guide, Technical Specifications per Compute Capability, "
               "https://docs.nvidia.com/cuda/cuda-c-programming-guide/")


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's numbers. Units are in the field names; ``None`` means "not known"."""

    name: str
    sms: int
    smem_per_sm_kib: float
    l2_mib: float
    hbm_gib: float
    hbm_tbs: float | None
    fp16_tensor_tflops: float | None  # dense, FP32 accumulate (bf16 runs at the same rate)
    fp32_tflops: float | None         # CUDA cores, no tensor cores
    source: str
    arch: str = ""
    compute_capability: str = ""
    smem_per_block_kib: float | None = None
    memory_type: str = ""
    regs_per_sm_kib: float = 256.0    # 65536 32-bit registers per SM on every GPU here
    notes: str = ""

    @property
    def smem_per_sm_bytes(self) -> int:
        return int(self.smem_per_sm_kib * 1024)

    @property
    def smem_per_block_bytes(self) -> int | None:
        return None if self.smem_per_block_kib is None else int(self.smem_per_block_kib * 1024)

    @property
    def smem_total_mib(self) -> float:
        """Shared memory of the whole chip (every SM's), in MiB."""
        return self.sms * self.smem_per_sm_kib / 1024

    def peak_tflops(self, dtype: str = "fp16") -> float | None:
        """Peak FLOP/s in TFLOP/s for ``dtype``: 'fp16'/'bf16' (tensor cores) or 'fp32'."""
        dtype = _normalise_dtype(dtype)
        return self.fp32_tflops if dtype == "fp32" else self.fp16_tensor_tflops

    def ridge_point(self, dtype: str = "fp16") -> float | None:
        """FLOPs per byte of HBM traffic above which an operation is compute-bound."""
        peak = self.peak_tflops(dtype)
        if peak is None or not self.hbm_tbs:
            return None
        return peak / self.hbm_tbs


def _normalise_dtype(dtype) -> str:
    text = str(dtype).replace("torch.", "").lower()
    aliases = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
               "float": "fp32"}
    text = aliases.get(text, text)
    if text not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"dtype must be 'fp16', 'bf16' or 'fp32', got {dtype!r}")
    return text


GPUS: dict[str, GPUSpec] = {
    "A100-40GB": GPUSpec(
        name="NVIDIA A100 40GB (SXM4)", sms=108, smem_per_sm_kib=164, smem_per_block_kib=163,
        l2_mib=40, hbm_gib=40, hbm_tbs=1.555, fp16_tensor_tflops=312, fp32_tflops=19.5,
        arch="Ampere", compute_capability="8.0", memory_type="HBM2",
        source=f"{_A100_DATASHEET}; {_AMPERE_WP}; {_CUDA_GUIDE}",
        notes="312 TFLOP/s dense (624 with 2:4 sparsity); 192 KiB L1+shared per SM"),
    "A100-80GB": GPUSpec(
        name="NVIDIA A100 80GB (SXM4)", sms=108, smem_per_sm_kib=164, smem_per_block_kib=163,
        l2_mib=40, hbm_gib=80, hbm_tbs=2.039, fp16_tensor_tflops=312, fp32_tflops=19.5,
        arch="Ampere", compute_capability="8.0", memory_type="HBM2e",
        source=f"{_A100_DATASHEET}; {_AMPERE_WP}; {_CUDA_GUIDE}",
        notes="the PCIe card has 1.935 TB/s"),
    "H100-SXM": GPUSpec(
        name="NVIDIA H100 SXM5 80GB", sms=132, smem_per_sm_kib=228, smem_per_block_kib=227,
        l2_mib=50, hbm_gib=80, hbm_tbs=3.35, fp16_tensor_tflops=989.4, fp32_tflops=67,
        arch="Hopper", compute_capability="9.0", memory_type="HBM3",
        source=f"{_H100_DATASHEET}; {_HOPPER_WP}; {_CUDA_GUIDE}",
        notes="1979 TFLOP/s with sparsity; 256 KiB L1+shared per SM"),
    "H100-PCIe": GPUSpec(
        name="NVIDIA H100 PCIe 80GB", sms=114, smem_per_sm_kib=228, smem_per_block_kib=227,
        l2_mib=50, hbm_gib=80, hbm_tbs=2.0, fp16_tensor_tflops=756, fp32_tflops=51,
        arch="Hopper", compute_capability="9.0", memory_type="HBM2e",
        source=f"{_H100_DATASHEET}; {_HOPPER_WP}; {_CUDA_GUIDE}",
        notes="1513 TFLOP/s with sparsity"),
    "H200": GPUSpec(
        name="NVIDIA H200 SXM 141GB", sms=132, smem_per_sm_kib=228, smem_per_block_kib=227,
        l2_mib=60, hbm_gib=141, hbm_tbs=4.8, fp16_tensor_tflops=989.4, fp32_tflops=67,
        arch="Hopper", compute_capability="9.0", memory_type="HBM3e",
        source=(f"{_H200_DATASHEET}; {_CUDA_GUIDE}; L2 and SM count: "
                "cudaDeviceProp (torch.cuda.get_device_properties) of an H200"),
        notes="same GH100 chip and compute as the H100 SXM, more and faster memory; the "
              "datasheet gives no L2 size, the driver reports 60 MiB"),
    "RTX-4090": GPUSpec(
        name="NVIDIA GeForce RTX 4090", sms=128, smem_per_sm_kib=100, smem_per_block_kib=99,
        l2_mib=72, hbm_gib=24, hbm_tbs=1.008, fp16_tensor_tflops=165.2, fp32_tflops=82.6,
        arch="Ada Lovelace", compute_capability="8.9", memory_type="GDDR6X",
        source=f"{_ADA_WP} (Appendix A, RTX 4090); {_CUDA_GUIDE}",
        notes="FP16 tensor with FP16 accumulate: 330.3 TFLOP/s; with FP32 accumulate (used "
              "here) 165.2; GDDR6X, not HBM"),
    "L4": GPUSpec(
        name="NVIDIA L4", sms=58, smem_per_sm_kib=100, smem_per_block_kib=99,
        l2_mib=48, hbm_gib=24, hbm_tbs=0.300, fp16_tensor_tflops=121, fp32_tflops=30.3,
        arch="Ada Lovelace", compute_capability="8.9", memory_type="GDDR6",
        source=f"{_L4_DATASHEET}; {_ADA_WP}; {_CUDA_GUIDE}",
        notes="datasheet: 242 TFLOP/s FP16 with sparsity, so 121 dense; GDDR6, not HBM"),
}

# How the driver names each GPU (torch.cuda.get_device_name), most specific pattern first.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"H200", "H200"),
    (r"H100.*PCIe", "H100-PCIe"),
    (r"H100", "H100-SXM"),        # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"A100.*80\s*GB", "A100-80GB"),
    (r"A100", "A100-40GB"),
    (r"RTX 4090", "RTX-4090"),
    (r"\bL4\b", "L4"),
)


def get_gpu(name: str) -> GPUSpec:
    """The table's row for a short name ('H100-SXM') or a driver name ('NVIDIA H100 80GB HBM3')."""
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name in GPUS:
        return GPUS[name]
    lowered = {k.lower(): k for k in GPUS}
    if name.lower() in lowered:
        return GPUS[lowered[name.lower()]]
    key = match_name(name)
    if key is None:
        raise ValueError(f"unknown GPU {name!r}; the table has {', '.join(GPUS)}")
    return GPUS[key]


def match_name(device_name: str) -> str | None:
    """The ``GPUS`` key of a driver's device name, or None if the table lacks that GPU."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return key
    return None


def from_properties(props) -> GPUSpec:
    """A GPUSpec from ``torch.cuda.get_device_properties(...)`` (or any object like it).

    Sizes come from the live device; throughput figures from the table where the name is known.
    """
    name = str(props.name)
    key = match_name(name)
    row = GPUS.get(key) if key else None
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    smem_block = getattr(props, "shared_memory_per_block_optin", None)
    l2 = getattr(props, "L2_cache_size", None)
    live = {
        "name": name,
        "sms": int(props.multi_processor_count),
        "hbm_gib": round(props.total_memory / 2**30, 1),
        "compute_capability": f"{props.major}.{props.minor}",
    }
    if smem_sm:
        live["smem_per_sm_kib"] = smem_sm / 1024
    if smem_block:
        live["smem_per_block_kib"] = smem_block / 1024
    if l2:
        live["l2_mib"] = l2 / 2**20
    if row is not None:
        return dataclasses.replace(
            row, **live,
            source=f"live device properties; throughput and bandwidth from GPUS[{key!r}]: "
                   f"{row.source}")
    return GPUSpec(
        smem_per_sm_kib=live.pop("smem_per_sm_kib", 0.0), l2_mib=live.pop("l2_mib", 0.0),
        hbm_tbs=None, fp16_tensor_tflops=None, fp32_tflops=None,
        source="live device properties only: this GPU is not in course_lib.hardware.GPUS",
        **live)


@functools.lru_cache(maxsize=None)
def sm_count(interpret: bool = False) -> int:
    """SMs of the current GPU; 1 in Triton's interpreter (``interpret``: ``course_lib.INTERPRET``),
    which runs a grid's programs one after another."""
    import torch

    return 1 if interpret else torch.cuda.get_device_properties(None).multi_processor_count


@functools.lru_cache(maxsize=None)
def bandwidth_per_sm(interpret: bool = False) -> float | None:
    """Peak DRAM bytes/s per SM of the current GPU (``dram_bandwidth``; an H100 SXM 25.4 GB/s,
    an H200 36.5 GB/s), or None in the interpreter or where torch reports no memory clock."""
    import torch

    props = None if interpret else torch.cuda.get_device_properties(None)
    bandwidth = props and dram_bandwidth(props)
    return bandwidth / props.multi_processor_count if bandwidth else None


def dram_bandwidth(props) -> float | None:
    """Peak DRAM bandwidth in bytes/s from ``torch.cuda.get_device_properties(...)``: memory
    clock × 2 transfers per clock × bus width (an H100 SXM: 2619 MHz × 2 × 5120 bits = 3.35
    TB/s; an H200: 3201 MHz × 2 × 6016 bits = 4.81 TB/s), or None where torch reports no
    memory clock."""
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    return clock_khz * 1e3 * 2 * bus_bits / 8 if clock_khz and bus_bits else None


def current_gpu() -> GPUSpec | None:
    """The GPU torch sees (device 0) as a GPUSpec, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return from_properties(torch.cuda.get_device_properties(0))


def table(gpus: dict[str, GPUSpec] | None = None) -> str:
    """The GPUs side by side as a plain-text table (one row per GPU)."""
    gpus = GPUS if gpus is None else gpus
    head = ["GPU", "SMs", "smem/SM KiB", "L2 MiB", "memory GiB", "TB/s", "fp16 TFLOP/s",
            "fp32 TFLOP/s", "FLOP/B"]
    rows = [head]
    for key, g in gpus.items():
        ridge = g.ridge_point("fp16")
        rows.append([key, str(g.sms), f"{g.smem_per_sm_kib:g}", f"{g.l2_mib:g}",
                     f"{g.hbm_gib:g}", _fmt(g.hbm_tbs, "{:.2f}"),
                     _fmt(g.fp16_tensor_tflops, "{:.0f}"), _fmt(g.fp32_tflops, "{:.1f}"),
                     _fmt(ridge, "{:.0f}")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _fmt(x, spec: str) -> str:
    return "?" if x is None else spec.format(x)
