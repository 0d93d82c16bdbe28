"""Input checks shared by every attention kernel wrapper of the course.

A wrapper calls these before it allocates or launches anything, so bad input gets a
``ValueError`` or ``TypeError`` that names the argument instead of a wrong answer.
"""
from __future__ import annotations

import torch

from course_lib._device import DEVICE, refuse_bf16_in_interpreter

GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Head dims the attention kernels take: every multiple of 8 from 16 to 256. A row of D fp16
# numbers is then a whole number of 16-byte vectors; the kernels pad D to the next power of two
# for ``tl.arange`` and mask the columns past D (40 -> 64, 80 -> 128, 160 -> 256).
HEAD_DIMS = tuple(range(16, 257, 8))
# The teaching kernels of lessons 03 to 07 keep to powers of two (tl.arange's own rule).
POW2_HEAD_DIMS = (16, 32, 64, 128, 256)
# An 8-bit KV cache (``course_lib.kvquant``): the decode kernels take it with per-token scales.
KV_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_tensor(name: str, t, ndim: int, dtypes: tuple = GPU_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        use = ("float16, bfloat16 or float32" if dtypes == GPU_DTYPES
               else " or ".join(str(d).removeprefix("torch.") for d in dtypes))
        raise TypeError(f"{name} has dtype {t.dtype}; use {use}")
    if not (t.is_cuda if DEVICE == "cuda" else t.is_cpu):  # (t.device.type costs ~5x more)
        raise ValueError(f"{name} is on {t.device}, but the course's kernels run on "
                         f"{DEVICE!r} (see course_lib.describe())")


def check_attention_inputs(q, k, v, head_dims=HEAD_DIMS, quantized_kv: bool = False):
    """Validate q (B, H, N_q, D), k and v (B, H_kv, N_k, D); return (B, H, H_kv, N_q, N_k, D).
    ``quantized_kv``: k and v are an 8-bit cache (one of ``KV_QUANT_DTYPES``, the same for both;
    their scales are checked by ``check_kv_scale``), q any of ``GPU_DTYPES``."""
    check_tensor("q", q, 4)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 4, KV_QUANT_DTYPES if quantized_kv else GPU_DTYPES)
    if quantized_kv and k.dtype != v.dtype:
        raise TypeError(f"k and v must share one dtype, got {k.dtype} and {v.dtype}")
    if not quantized_kv and not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.get_device() == k.get_device() == v.get_device()):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, N_q, D = q.shape
    Bk, H_kv, N_k, Dk = k.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"k has batch {Bk} but q has batch {B}")
    if Dk != D:
        raise ValueError(f"k has head dim {Dk} but q has head dim {D}")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"q's {H} heads must be a multiple of k/v's {H_kv} heads (GQA)")
    if D not in head_dims:
        allowed = ("a multiple of 8 from 16 to 256" if tuple(head_dims) == HEAD_DIMS
                   else f"one of {tuple(head_dims)}")
        raise ValueError(f"head dim {D} of q is not supported; use {allowed}")
    if N_q == 0 or N_k == 0:
        raise ValueError(f"sequence lengths must be positive, got N_q={N_q}, N_k={N_k}")
    refuse_bf16_in_interpreter(q, k, v, names=("q", "k", "v"))
    return B, H, H_kv, N_q, N_k, D


def check_sm_scale(sm_scale, D: int) -> float:
    if sm_scale is None:
        return D ** -0.5
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a number or None, got {type(sm_scale).__name__}")
    sm_scale = float(sm_scale)
    if not (sm_scale > 0 and sm_scale < float("inf")):
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale}")
    return sm_scale


def check_kv_scale(name: str, scale, cache_name: str, cache) -> None:
    """TypeError or ValueError naming ``name`` unless ``scale`` is what an 8-bit ``cache`` needs:
    fp32, the cache's shape without its last dim (one scale per token and head), on its device;
    and unless the cache is 8-bit where a scale is given at all."""
    quantized = cache.dtype in KV_QUANT_DTYPES
    if scale is None:
        if quantized:
            raise ValueError(f"{name} is required with a {cache.dtype} {cache_name}: one fp32 "
                             f"scale per token and head, shape {tuple(cache.shape[:-1])} "
                             "(course_lib.kvquant.quantize_kv)")
        return
    if not quantized:
        raise ValueError(f"{name} is for an int8 or float8_e4m3fn {cache_name}, but "
                         f"{cache_name} is {cache.dtype}: leave {name} None")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of float32, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if scale.shape != cache.shape[:-1]:
        raise ValueError(f"{name} must have shape {tuple(cache.shape[:-1])} ({cache_name}'s "
                         f"without its last dim), got {tuple(scale.shape)}")
    if scale.device != cache.device:
        raise ValueError(f"{name} is on {scale.device} but {cache_name} is on {cache.device}")


def check_int_tensor(name: str, t, length: int, device, ndim: int = 1, shape: str = "") -> None:
    """TypeError or ValueError unless ``t`` is an integer tensor on ``device`` of ``ndim``
    dimensions, ``length`` rows (``shape`` states it in the message; default: one per sequence)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must hold integers (int32), got {t.dtype}")
    if t.ndim != ndim or t.shape[0] != length:
        shape = shape or f"({length},) (one length per sequence)"
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_block_table(block_table, cache_seqlens, num_blocks, block_size, capacity):
    """ValueError if a length exceeds the table or a block id a sequence uses is out of range."""
    lens = cache_seqlens.to(torch.int64)
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0 or hi > capacity:
        raise ValueError(f"cache_seqlens must lie in [0, {capacity}] (block_table's "
                         f"{block_table.shape[1]} blocks × block_size {block_size}), "
                         f"got values in [{lo}, {hi}]")
    used_blocks = (lens + block_size - 1) // block_size  # (B,)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols[None, :] < used_blocks[:, None]  # (B, max_blocks)
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a block id "
                         f"in [0, {num_blocks}) (num_blocks of k_pages), and sequence {b} "
                         f"uses that block")


def check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 read_values: bool = False) -> int:
    """Packed sequences (q (total_q, H, D), k (total_k, H_kv, D)): shapes, dtypes and devices of
    ``cu_seqlens_*`` (int32, (B + 1,)) and the ``max_seqlen_*`` ints; returns B. With
    ``read_values`` also their values, read back from the device (one synchronisation): each
    starts at 0, never decreases, ends at its tensor's length, and no sequence is longer than
    its ``max_seqlen``."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise TypeError("cu_seqlens_q and cu_seqlens_k must be int32 tensors of B + 1 offsets")
    B = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else -1
    if B < 1:
        raise ValueError("cu_seqlens_q must be an int32 tensor of B + 1 >= 2 offsets")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_int_tensor(name, cu, B + 1, q.device)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (FlashAttention's varlen layout), "
                            f"got {cu.dtype}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise TypeError(f"{name} must be a non-negative int (the longest sequence), got {m!r}")
    if read_values:
        for name, cu, total, name_max, longest in (
                ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
                ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)):
            vals = cu.tolist()
            if vals[0] != 0:
                raise ValueError(f"{name} must start at 0, got {vals[0]}")
            lens = [b - a for a, b in zip(vals, vals[1:])]
            if min(lens) < 0:
                raise ValueError(f"{name} must not decrease, got {vals}")
            if vals[-1] != total:
                raise ValueError(f"{name} ends at {vals[-1]} but its tensor has {total} rows")
            if max(lens) > longest:
                raise ValueError(f"{name_max} = {longest} is shorter than a sequence of "
                                 f"{max(lens)}")
    return B
