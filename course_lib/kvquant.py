"""A quantized KV cache: 8-bit keys and values with one fp32 scale per token and head.

Introduced in notebooks/16_serving.ipynb (section 7). Lessons 12 and 13's ``flash_decode`` and
``paged_decode`` also take such a cache (``k_scale=``, ``v_scale=``) and dequantise it inside
the split kernel (``course_lib.kernels.decode``). A decode step reads every
byte of K and V for few FLOPs (lesson 11), so its time follows the cache's bytes: one byte a
value instead of two halves them, plus a 4-byte scale per token and head for each of K and V
(``kv_bytes_per_token``).

The scheme: each row of D values of a token and head gets its own scale, its absmax mapped onto
the format's largest value, ``x ≈ x_q · scale``:

* int8: ``scale = absmax / 127``, x_q = round(x / scale) clamped to [-127, 127] (symmetric:
  -128 is never used), so |x - x_q · scale| <= scale / 2;
* ``torch.float8_e4m3fn``: ``scale = absmax / 448`` (``course_lib.fp8.E4M3_MAX``), x_q = x / scale
  rounded to nearest even by the cast: a relative error of at most 2^-4 (3 mantissa bits), and
  at most 2^-10 · scale for the smallest values (e4m3's subnormals step by 2^-9).

A row of zeros gets scale 1 (and x_q = 0). Both formats' values are exact in fp16 and bf16
(integers up to 127; e4m3's 3 mantissa bits and its exponents), so a kernel converts a loaded
tile to q's dtype and applies the scales outside its two products (``kernels/decode.py``).

vLLM stores its cache in FP8 too, with one scale per tensor or per head, not per token (vLLM,
"Quantized KV Cache", https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/).
Going further: KIVI (Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen and Hu, "KIVI: A Tuning-Free
Asymmetric 2bit Quantization for KV Cache", ICML 2024, https://arxiv.org/abs/2402.02750,
section 3) finds that keys have outlier *channels* and values do not: it quantizes keys per
channel and values per token, asymmetrically (a zero point as well as a scale), down to 2 bits.
A per-token scale, as here, is the simplest scheme a kernel can apply to a key's whole score at
once; per-channel key scales would multiply q instead.
"""
from __future__ import annotations

import torch

from course_lib.fp8 import E4M3, E4M3_MAX
from course_lib.validate import KV_QUANT_DTYPES

INT8_MAX = 127.0  # symmetric int8: [-127, 127]
QMAX = {torch.int8: INT8_MAX, E4M3: E4M3_MAX}  # the value a row's absmax is mapped onto
SCALE_BYTES = 4  # one fp32 scale per token and head, for K and for V


def _check_dtype(dtype) -> None:
    if dtype not in KV_QUANT_DTYPES:
        raise ValueError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """(x_q, scale): ``x`` quantized to ``dtype`` with one fp32 scale per row of its last dim.

    x (..., N, D): a contiguous cache (B, H_kv, N, D) or pages (num_blocks, block_size, H_kv, D);
    a row is one token of one head either way. Returns x_q shaped like x in ``dtype`` (torch.int8
    or torch.float8_e4m3fn) and scale shaped like x without its last dim (fp32), such that
    ``dequantize_kv(x_q, scale)`` ≈ x."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    _check_dtype(dtype)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a last dim (D) of at least 1, got shape {tuple(x.shape)}")
    x = x.float()
    qmax = QMAX[dtype]
    absmax = x.abs().amax(-1)  # (...,) one per token and head
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    y = (x / scale[..., None]).clamp(-qmax, qmax)  # (clamp: absmax / scale may round past qmax)
    x_q = y.round().to(dtype) if dtype == torch.int8 else y.to(dtype)  # e4m3: nearest even
    return x_q, scale


def dequantize_kv(x_q: torch.Tensor, scale: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_q · scale in ``dtype`` (fp32 by default): what a kernel computes with."""
    if not isinstance(x_q, torch.Tensor) or x_q.dtype not in KV_QUANT_DTYPES:
        raise TypeError(f"x_q must be an int8 or float8_e4m3fn tensor, got "
                        f"{getattr(x_q, 'dtype', type(x_q).__name__)}")
    if not isinstance(scale, torch.Tensor) or scale.shape != x_q.shape[:-1]:
        raise ValueError(f"scale must have x_q's shape without its last dim, "
                         f"{tuple(x_q.shape[:-1])}, got {tuple(getattr(scale, 'shape', ()))}")
    return (x_q.float() * scale.float()[..., None]).to(dtype)


def kv_bytes_per_token(H_kv: int, D: int, dtype: torch.dtype) -> int:
    """Bytes one token adds to one layer's cache: K and V, H_kv heads of D values each, plus
    (for an 8-bit dtype) their fp32 scales, one per head for K and one for V.

    >>> kv_bytes_per_token(8, 128, torch.float16), kv_bytes_per_token(8, 128, torch.int8)
    (4096, 2112)
    """
    values = 2 * H_kv * D * torch.empty((), dtype=dtype).element_size()
    return values + (2 * SCALE_BYTES * H_kv if dtype in KV_QUANT_DTYPES else 0)


__all__ = ["QMAX", "dequantize_kv", "kv_bytes_per_token", "quantize_kv"]
