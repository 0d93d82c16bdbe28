"""A tiled matrix multiplication in Triton: C = A·B with an fp32 accumulator.

Introduced in notebooks/03_tiled_matmul.ipynb, after the tiled loop nest of
``course_lib.iomodel.matmul``. One program computes one BLOCK_M×BLOCK_N tile of C: it walks K
in steps of BLOCK_K, loading an A tile and a B tile (Triton stages them through shared
memory), and accumulates ``tl.dot`` of the two in fp32 registers. It stores C once.

Three details, as in Triton's matmul tutorial (03-matrix-multiplication.py):

* **ragged edges**: rows and columns past M and N are clamped by ``% M`` / ``% N`` on the load
  (they read valid memory that no one stores), the K tail is masked to 0, and the store masks
  rows and columns outside C: any M, N, K works, not only multiples of the tile;
* **grouped ordering (L2 swizzle)**: consecutive program ids walk GROUP_M rows of tiles down a
  column before moving right, so tiles that run at the same time share A rows and B columns and
  many of the re-reads the IO model counts hit the L2 cache instead of HBM;
* **autotuning** on a GPU over the configurations in ``_gpu_configs()``, pruned by
  ``_prune_configs`` (shared memory of the device, problem size) and keyed on (M, N, K); in the
  interpreter one small configuration and no tuning.

Grid: one program per C tile, ⌈M/BLOCK_M⌉·⌈N/BLOCK_N⌉ programs, in grouped order.
FLOPs: 2·M·N·K. Speed on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22
(both called eagerly, ``do_bench`` median; course_lib/data/matmul.json):
4096³ fp16: 670 TFLOP/s against cuBLAS 693 (0.97x).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE, INTERPRET, refuse_bf16_in_interpreter
from course_lib.validate import check_tensor

INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2}


def _gpu_configs() -> list[triton.Config]:
    """Candidate tilings for a GPU. Hopper favours 128×256 and 256×128 tiles with 8 warps;
    Ampere and Ada the smaller ones; the pruner removes what a device cannot hold."""
    cfg = []
    for bm, bn, bk, stages, warps in (
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 3, 4),
        (128, 128, 32, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 256, 32, 4, 4),
        (128, 64, 32, 4, 4),
        (64, 128, 32, 4, 4),
        (128, 32, 32, 4, 4),
        (64, 32, 32, 5, 2),
        (32, 64, 32, 5, 2),
        (32, 32, 32, 4, 2),
        # (256, 256, 64, 3, 8) is left out: its 3 stages need 192 KiB of shared memory and
        # 256 fp32 accumulators per thread, which spill on every GPU of the table.
    ):
        cfg.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                 num_stages=stages, num_warps=warps))
    return cfg


@functools.lru_cache(maxsize=None)
def _device_smem_bytes(device: int = 0) -> int:
    """Shared memory one block may use on a GPU (the opt-in maximum)."""
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    from triton.runtime import driver  # older torch: ask Triton's driver

    return int(driver.active.utils.get_device_properties(device)["max_shared_mem"])


def _prune_configs(configs, named_args, **kwargs):
    """Drop configurations that cannot run here or that waste most of a tile.

    * shared memory: num_stages × (BLOCK_M·BLOCK_K + BLOCK_K·BLOCK_N) × element size must fit
      in the device's per-block shared memory;
    * size: a tile more than twice as tall as M (or wide as N) computes mostly padding, so for
      small problems only tiles up to the next power of two of M and N remain.
    Always returns at least one configuration (the smallest).
    """
    M, N = named_args["M"], named_args["N"]
    elsize = named_args["a_ptr"].element_size() if hasattr(named_args["a_ptr"],
                                                           "element_size") else 2
    smem = _device_smem_bytes(torch.cuda.current_device()) if DEVICE == "cuda" else 1 << 30
    m_cap = max(32, triton.next_power_of_2(M))
    n_cap = max(32, triton.next_power_of_2(N))
    kept = []
    for c in configs:
        k = c.kwargs
        need = c.num_stages * (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * elsize
        if need > smem or k["BLOCK_M"] > m_cap or k["BLOCK_N"] > n_cap:
            continue
        kept.append(c)
    if not kept:
        kept = [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    return kept


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config(dict(INTERPRETER_CONFIG), num_stages=1, num_warps=1)]
    return _gpu_configs()


@triton.autotune(configs=_configs(), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # --- which tile of C this program owns, in grouped order (L2 swizzle) ---
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n          # programs in one band of GROUP_M tile rows
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last band may be shorter
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # --- pointers to the first A tile (BLOCK_M, BLOCK_K) and B tile (BLOCK_K, BLOCK_N) ---
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M   # rows past M wrap: never stored
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)

    # --- walk K: load two tiles, multiply-accumulate in fp32 ---
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)                       # (BLOCK_M, BLOCK_N)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:  # the last step hangs over K: masked elements read as 0 and add nothing
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # --- store the C tile once, masking rows and columns outside C ---
    c = acc.to(c_ptr.dtype.element_ty)
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    tl.store(c_ptrs, c, mask=mask)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = a @ b by the course's tiled Triton kernel (fp32 accumulation, output in a's dtype).

    ``a`` (M, K), ``b`` (K, N), same dtype (float16, bfloat16 on a GPU only, or float32) on the
    course's device. Any strides; any sizes. float32 inputs are multiplied in full fp32
    (``input_precision="ieee"``), not TF32; on a GPU that runs on CUDA cores and sums along K in
    order, so its error, though within the classical γ_K·|A|·|B| bound, is a few times
    cuBLAS's (tests/test_matmul.py). fp16 and bf16 errors match cuBLAS's.
    """
    check_tensor("a", a, 2)
    check_tensor("b", b, 2)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share one dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)} (K = {a.shape[1]}), "
                         f"b is {tuple(b.shape)} (K = {b.shape[0]})")
    refuse_bf16_in_interpreter(a, b, names=("a", "b"))
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # tf32 is ignored for fp16/bf16

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_kernel[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        INPUT_PRECISION=precision,
    )
    return c


def best_config(M: int, N: int, K: int, dtype=torch.float16) -> dict | None:
    """The configuration the autotuner chose for this shape (None before it ran)."""
    cache = getattr(_matmul_kernel, "cache", {})
    for key, cfg in cache.items():
        if tuple(key[:3]) == (M, N, K) and str(dtype) in map(str, key[3:]):
            return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return None


def program_tile(pid: int, num_pid_m: int, num_pid_n: int, group_m: int) -> tuple[int, int]:
    """The (tile row, tile column) of C that program ``pid`` computes: the kernel's grouped
    ordering, line for line in Python (notebook 03 counts the tiles a wave of programs touches).
    """
    num_pid_in_group = group_m * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * group_m
    group_size_m = min(num_pid_m - first_pid_m, group_m)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


def panels_touched(num_pid_m: int, num_pid_n: int, group_m: int, programs: int) -> int:
    """How many A row panels plus B column panels the first ``programs`` programs need.

    With ``group_m = 1`` the order is row-major. Fewer panels per wave of programs means more of
    the wave's loads are shared, so they come from L2 rather than HBM.
    """
    tiles = [program_tile(p, num_pid_m, num_pid_n, group_m)
             for p in range(min(programs, num_pid_m * num_pid_n))]
    return len({m for m, _ in tiles}) + len({n for _, n in tiles})


def kernel_source() -> str:
    """The text of ``_matmul_kernel`` (notebook 03 prints it; works compiled and interpreted)."""
    import inspect
    import sys

    src = inspect.getsource(sys.modules[__name__])
    return src[src.index("@triton.jit\ndef _matmul_kernel"):src.index("\n\ndef matmul(")].strip()
