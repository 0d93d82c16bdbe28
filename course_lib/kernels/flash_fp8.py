"""FlashAttention-2 forward in FP8 (e4m3) for Hopper (sm_90): lesson 09b's model as a kernel.

Introduced in notebooks/09b_fp8.ipynb, which measures what e4m3 costs in accuracy
(``course_lib.fp8``, an exact emulation); this kernel rounds what that model rounds, in the
same way, so its error can be set beside the model's. FlashAttention-3 (Shah et al. 2024,
"FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision", section
3.3, https://arxiv.org/abs/2407.08608) runs its forward this way:

1. **Block quantization.** Q takes one scale per BLOCK_M rows, K and V one per BLOCK_N rows,
   each mapping its block's largest magnitude onto e4m3's 448 (``to_e4m3_blocks``, on the
   host). The tiles the kernel loads are exactly those blocks, so a tile's scores are
   ``q_scale · k_scale · (Q̂ K̂ᵀ)`` with one scalar per tile.
2. **Incoherent processing** (``rotate=True``): Q and K multiplied by one random orthogonal
   matrix (``course_lib.fp8.random_rotation``) before their quantization; QKᵀ is unchanged.
3. **P in e4m3 too.** P (at most 1 after the row max is taken out) is cast as P · ``P_SCALE``
   for the PV product; the row sums l come from P before the cast, as the model's do.

Both products run on the FP8 tensor cores (fp32 accumulation). Hopper's FP8 wgmma takes both
operands K-major: for PV that is V's key dimension, so V is stored transposed, (B, H, D, N)
(as Triton's tutorial 06 stores it). The tiles are TMA tiles, clipped at the tensors' ends.

Speed on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29 (fp16 inputs made e4m3
beforehand, B·N = 32k, H·D = 2048; every provider called eagerly, ``do_bench`` median, in turns,
3 rounds; FLOPs 4·B·H·N²·D, half for causal; ``python -m course_lib.bench fp8``,
course_lib/data/fp8_fwd.json). With ``fp8_config``'s tiles (64 × 128, 4 warps): D 128, N 16k, 735
and 685 TFLOP/s non-causal and causal, against our fp16 forward's 533 and 518 and SDPA
CUDNN_ATTENTION's 582 and 546 (N 1k to 16k: 1.38–1.46× our fp16 non-causal, 1.23–1.32× causal);
D 64, N 16k, 524 and 472 against fp16's 521 and 504: no gain at D 64. The quantization (rotation
included) is not in these times: the whole ``ops.flash_attn_fp8`` call ran at 455 and 319 TFLOP/s
(D 128, N 16k).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from course_lib._device import INTERPRET
from course_lib.fp8 import E4M3, E4M3_MAX, P_SCALE, random_rotation
from course_lib.kernels.attention_common import (
    INTERPRETER_BLOCKS,
    LOG2E,
    _causal_bounds,
    _epilogue,
    _q_block_program,
    _softmax_scores,
    cdiv,
    launch,
)

P_SCALE_C = tl.constexpr(P_SCALE)


@triton.jit
def _e4m3_grid(x):
    """x >= 0 rounded to the nearest e4m3 value, ties to even, in fp32. Only the interpreter
    needs it: its fp32 -> e4m3 cast rounds half up and loses the carry into the exponent
    (127.4 becomes 64), Triton 3.6 to 3.9; a GPU's cast rounds as this does, in one
    instruction. Below 2^-6 e4m3 steps by 2^-9, which fp32 addition of 2^14 rounds to."""
    tiny = (x + 16384.0) - 16384.0
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits
    return tl.where(x < 0.015625, tiny, bits.to(tl.float32, bitcast=True))


@triton.jit
def _fp8_inner(acc, m_i, l_i, q, desc_k, desc_vt, K_SCALE, V_SCALE, b, h_kv, offs_m, lo, hi,
               N_K, q_offset, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, EXACT_CAST: tl.constexpr):
    """Key blocks [lo, hi) with the running max; ``qk_scale`` holds sm_scale · log2 e and this
    query block's scale, K_SCALE and V_SCALE point at this head's block scales."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        blk = start_n // BLOCK_N
        k = desc_k.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, k.T)  # (BLOCK_M, BLOCK_N) fp32, in units of q_scale · k_scale
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n[None, :] < N_K
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + q_offset)
        p, alpha, m_i = _softmax_scores(qk, m_i, valid, qk_scale * tl.load(K_SCALE + blk),
                                        MASKED)
        l_i = l_i * alpha + tl.sum(p, 1)  # from P before its cast
        vt = desc_vt.load([b, h_kv, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
        p = p * P_SCALE_C
        if EXACT_CAST:  # (the interpreter: see _e4m3_grid)
            p = _e4m3_grid(p)
        pv = tl.dot(p.to(tl.float8e4nv), vt.T)  # (BLOCK_M, HEAD_DIM)
        acc = acc * alpha[:, None] + pv * (tl.load(V_SCALE + blk) / P_SCALE_C)
    return acc, m_i, l_i


@triton.jit
def _flash_fwd_fp8_kernel(
    desc_q, desc_k, desc_vt, desc_o, Q_SCALE, K_SCALE, V_SCALE, LSE,
    qk_scale, H, GROUP, N_Q, N_K, Q_BLOCKS, K_BLOCKS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr = True, EXACT_CAST: tl.constexpr = False,
):
    """Q_SCALE (B·H, Q_BLOCKS) and K_SCALE, V_SCALE (B·H_kv, K_BLOCKS): the blocks' scales."""
    pid_m, pid_bh, b, h, h_kv = _q_block_program(H, GROUP, CAUSAL)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # e4m3, rows past N_Q: 0
    qk_scale = qk_scale * tl.load(Q_SCALE + pid_bh.to(tl.int64) * Q_BLOCKS + pid_m)
    kv_blocks = (b * (H // GROUP) + h_kv).to(tl.int64) * K_BLOCKS
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo_masked, hi = _causal_bounds(start_m, N_Q, N_K, CAUSAL, BLOCK_M, BLOCK_N)
    q_offset = N_K - N_Q
    acc, m_i, l_i = _fp8_inner(acc, m_i, l_i, q, desc_k, desc_vt, K_SCALE + kv_blocks,
                               V_SCALE + kv_blocks, b, h_kv, offs_m, 0, lo_masked, N_K,
                               q_offset, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, EXACT_CAST)
    acc, m_i, l_i = _fp8_inner(acc, m_i, l_i, q, desc_k, desc_vt, K_SCALE + kv_blocks,
                               V_SCALE + kv_blocks, b, h_kv, offs_m, lo_masked, hi, N_K,
                               q_offset, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, EXACT_CAST)
    o, lse = _epilogue(acc, m_i, l_i)
    desc_o.store([b, h, start_m, 0], o.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
    if STORE_LSE:
        tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


# The config each head dim runs: (BLOCK_M, BLOCK_N, num_warps, num_stages), the fastest of the
# candidates timed in turns at N 1k, 4k and 16k (course_lib/data/fp8_stages.json; ``bench.fp8
# .TILE_CANDIDATES`` at N 16k, fp8_fwd.json, "tiles"). Two stages (72 KB of shared memory at D
# 128, three take 104 KB): 9-11 % faster than three without a mask at D 128, 4-7 % at D 64; a
# causal call at D 128 takes three (``CAUSAL_STAGES``): two were 5-10 % slower there.
FP8_CONFIGS = {64: (64, 128, 4, 2), 128: (64, 128, 4, 2)}
CAUSAL_STAGES = {128: 3}


def fp8_config(head_dim: int, causal: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a call: ``FP8_CONFIGS`` with
    ``CAUSAL_STAGES`` for a causal one. The blocks do not depend on ``causal``: the inputs are
    quantized in them before the call."""
    block_m, block_n, warps, stages = FP8_CONFIGS[head_dim]
    return block_m, block_n, warps, CAUSAL_STAGES.get(head_dim, stages) if causal else stages


def fp8_blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the kernel for this head dim: the quantization's blocks too."""
    if head_dim not in FP8_CONFIGS:
        raise ValueError(f"the FP8 kernel takes head dims {tuple(FP8_CONFIGS)}, got {head_dim}")
    if INTERPRET:
        return INTERPRETER_BLOCKS["BLOCK_M"], INTERPRETER_BLOCKS["BLOCK_N"]
    return FP8_CONFIGS[head_dim][:2]


def to_e4m3_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, N, D) as e4m3 with one scale per ``block`` rows of each (batch, head): (x̂ (B, H,
    N, D) e4m3, scale (B, H, ⌈N / block⌉) fp32), x ≈ x̂ · scale. A scale maps its block's
    largest magnitude onto 448, as ``course_lib.fp8.fake_quantize`` does."""
    B, H, N, D = x.shape
    n_blocks = cdiv(N, block)
    tiles = torch.nn.functional.pad(x.float(), (0, 0, 0, n_blocks * block - N))
    tiles = tiles.reshape(B, H, n_blocks, block, D)
    scale = tiles.abs().amax(dim=(-2, -1)).clamp_min(1e-30) / E4M3_MAX  # (B, H, n_blocks)
    x8 = (tiles / scale[..., None, None]).to(E4M3).reshape(B, H, n_blocks * block, D)[:, :, :N]
    return x8, scale


class Fp8Inputs(NamedTuple):
    """Q, K and V ready for the kernel: e4m3, V transposed to (B, H_kv, D, N_k) (its last dim
    padded to a multiple of 16, as TMA's strides must be 16 bytes), and their block scales."""

    q: torch.Tensor
    k: torch.Tensor
    vt: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    n_k: int
    block_m: int
    block_n: int


def prepare_fp8(q, k, v, rotate: bool = True, seed: int = 0, blocks=None) -> Fp8Inputs:
    """q (B, H, N_q, D), k and v (B, H_kv, N_k, D) in e4m3 with the kernel's block scales; with
    ``rotate``, q and k first times ``random_rotation(D, seed)`` (FlashAttention-3's incoherent
    processing: QKᵀ unchanged). ``blocks``: (BLOCK_M, BLOCK_N) instead of ``fp8_blocks``'s (a
    GPU's tile benchmark)."""
    D, N_k = q.shape[-1], k.shape[2]
    block_m, block_n = blocks or fp8_blocks(D)
    if rotate:
        rot = random_rotation(D, seed).to(device=q.device, dtype=torch.float32)
        q, k = q.float() @ rot, k.float() @ rot
    q8, q_scale = to_e4m3_blocks(q, block_m)
    k8, k_scale = to_e4m3_blocks(k, block_n)
    v8, v_scale = to_e4m3_blocks(v, block_n)
    n_pad = cdiv(N_k, 16) * 16
    vt = torch.zeros((*v8.shape[:2], D, n_pad), device=v.device, dtype=E4M3)
    vt[..., :N_k] = v8.transpose(2, 3)
    return Fp8Inputs(q8.contiguous(), k8.contiguous(), vt, q_scale, k_scale, v_scale, N_k,
                     block_m, block_n)


def _descriptor(t: torch.Tensor, block: list) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, [1, 1, *block])


def forward_fp8(x: Fp8Inputs, causal: bool, sm_scale: float, out_dtype=torch.float16,
                store_lse: bool = True, out=None, warps_stages=None):
    """(o (B, H, N_q, D) in ``out_dtype``, lse (B, H, N_q) fp32 or None) of prepared inputs
    (``prepare_fp8``; the tiles are their blocks): the kernel alone, as FlashAttention-3's FP8
    speed is measured. ``out``: preallocated (o, lse), contiguous (tests poison them);
    ``warps_stages``: (num_warps, num_stages) instead of ``fp8_config``'s."""
    B, H, N_Q, D = x.q.shape
    H_KV = x.k.shape[1]
    block_m, block_n = x.block_m, x.block_n
    o, lse = out or (torch.empty((B, H, N_Q, D), device=x.q.device, dtype=out_dtype),
                     torch.empty((B, H, N_Q), device=x.q.device, dtype=torch.float32))
    descs = (_descriptor(x.q, [block_m, D]), _descriptor(x.k, [block_n, D]),
             _descriptor(x.vt, [D, block_n]), _descriptor(o, [block_m, D]))
    args = (*descs, x.q_scale, x.k_scale, x.v_scale, lse, sm_scale * LOG2E.value, H, H // H_KV,
            N_Q, x.n_k, x.q_scale.shape[-1], x.k_scale.shape[-1])
    meta = {"HEAD_DIM": D, "CAUSAL": bool(causal), "STORE_LSE": bool(store_lse),
            "EXACT_CAST": INTERPRET}
    warps, stages = warps_stages or fp8_config(D, causal)[2:]
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                           num_stages=stages)
    launch(_flash_fwd_fp8_kernel, lambda m: (cdiv(N_Q, m), B * H), args, meta, config)
    return o, (lse if store_lse else None)


__all__ = ["CAUSAL_STAGES", "FP8_CONFIGS", "Fp8Inputs", "forward_fp8", "fp8_blocks", "fp8_config",
           "prepare_fp8", "to_e4m3_blocks"]
