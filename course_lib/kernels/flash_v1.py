"""FlashAttention v1's forward pass as a Triton kernel: K/V blocks outside, Q blocks inside.

Introduced in notebooks/07_triton_flash_v1.ipynb. Reference: Dao et al., "FlashAttention: Fast
and Memory-Efficient Exact Attention with IO-Awareness" (NeurIPS 2022), Algorithm 1 (Algorithm 2
adds the mask; dropout is not part of this kernel).

One program per (batch, head): the grid is ``(B·H,)``. Each program walks the paper's loops::

    for j in K/V blocks:                       # outer: K_j, V_j loaded once into SRAM
        for i in Q blocks:                     # inner: Q_i, O_i, l_i, m_i read from HBM
            S_ij  = sm_scale · Q_i K_jᵀ                                   # (BLOCK_M, BLOCK_N)
            m~_ij = rowmax(S_ij);  P~_ij = exp(S_ij − m~_ij);  l~_ij = rowsum(P~_ij)
            m_new = max(m_i, m~_ij)
            l_new = e^(m_i − m_new)·l_i + e^(m~_ij − m_new)·l~_ij
            O_i   ← diag(l_new)⁻¹ (diag(l_i)·e^(m_i − m_new)·O_i + e^(m~_ij − m_new)·P~_ij V_j)
            write O_i, l_i, m_i back to HBM

O stays normalised after every step, so the last step's O_i is the answer. Two small changes
to the paper's bookkeeping, neither changing the loop structure: a row block's first step
starts from (O, l, m) = (0, 0, −∞) in registers instead of reading those values from HBM (the
paper initialises HBM with them), and its last step writes O_i in q's dtype to the output
instead of to the fp32 scratch. Exponentials are ``exp2`` with log2(e) folded into the scale
(the same numbers as ``exp``). ``causal=True`` is bottom-right aligned (``course_lib.reference``):
(i, j) block pairs entirely above the diagonal are skipped, the others are masked.

Why it is slower than v2 (``course_lib.kernels.flash_v2``), in numbers the lesson measures:

* **Bytes.** Every (i, j) step reads Q_i (dtype), O_i, l_i, m_i (fp32) and writes O_i, l_i,
  m_i back: for each (batch, head) about ⌈N_k/BLOCK_N⌉·N_q·(2·D·4 + D·2 + 16) bytes, against v2's
  minimum of reading Q, K, V and writing O once. ``course_lib.iomodel.attention.flash_v1_io(
  ..., kernel_bookkeeping=True)`` counts exactly what this kernel moves.
* **Parallelism.** Only B·H programs. At B·N = 32k tokens, N = 16k and D = 128 (B = 2,
  H = 16) that is 32 programs for the 132 SMs of an H100: most of the GPU idles. v2 also
  splits over Q blocks.
* **Work.** A division (normalisation) and two rescales per step instead of one at the end.

Speed on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22 (fp16, B·N = 32k,
H·D = 2048; called eagerly, ``do_bench`` median; FLOPs 4·B·H·N²·D;
course_lib/data/attention_fwd.json): D 128, N 16k, non-causal: 18 TFLOP/s, 0.04x the portable v2.
It slows down as N grows: B·H programs only, and O, l, m cross HBM once per K/V block (at the
FlashAttention paper's Figure 2 shape, 20x the minimum DRAM bytes; course_lib/data/hbm.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib._device import INTERPRET
from course_lib.kernels.attention_common import LOG2E, dot_precision, interpreter_errstate
from course_lib.validate import POW2_HEAD_DIMS, check_attention_inputs, check_sm_scale


@triton.jit
def _flash_fwd_v1_kernel(
    Q, K, V, Out, O_acc, L, M,  # O_acc (B·H, N_q, D), L and M (B·H, N_q): fp32 scratch in HBM
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, GROUP, N_Q, N_K, qk_scale,  # qk_scale = sm_scale·log2(e); GROUP = H // H_kv
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # --- which (batch, head) this program owns; GQA: query head h reads K/V head h // GROUP
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    h_kv = h // GROUP
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    o_base = Out + b * stride_ob + h * stride_oh
    acc_base = O_acc + pid.to(tl.int64) * N_Q * HEAD_DIM  # scratch rows of this (b, h)
    lm_off = pid.to(tl.int64) * N_Q

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_q_blocks = tl.cdiv(N_Q, BLOCK_M)
    n_k_blocks = tl.cdiv(N_K, BLOCK_N)
    DIAG = N_K - N_Q  # causal: query row r sees key c iff c <= r + DIAG

    # --- causal with N_q > N_k: leading Q blocks see no key at all; their O is 0
    if CAUSAL:
        i_seen = (tl.maximum(-DIAG - (BLOCK_M - 1), 0) + BLOCK_M - 1) // BLOCK_M
        for i in range(0, i_seen):
            rows = i * BLOCK_M + offs_m
            tl.store(o_base + rows[:, None] * stride_on + offs_d[None, :] * stride_od,
                     tl.zeros([BLOCK_M, HEAD_DIM], dtype=Out.dtype.element_ty),
                     mask=rows[:, None] < N_Q)

    for j in range(0, n_k_blocks):  # ---------- outer loop: one K/V block, loaded once
        cols = j * BLOCK_N + offs_n  # (BLOCK_N,)
        col_ok = cols < N_K
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=col_ok[:, None], other=0.0)  # (BLOCK_N, D)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None], other=0.0)  # (BLOCK_N, D)

        # Causal: Q block i sees this K block iff its last row's last key >= the block's first.
        i_lo = 0
        if CAUSAL:
            i_lo = (tl.maximum(j * BLOCK_N - DIAG - (BLOCK_M - 1), 0) + BLOCK_M - 1) // BLOCK_M
        for i in range(i_lo, n_q_blocks):  # ---------- inner loop: every Q block
            rows = i * BLOCK_M + offs_m  # (BLOCK_M,)
            row_ok = rows < N_Q
            # The last K block this Q block sees: there O is final and goes to Out.
            j_last = n_k_blocks - 1
            if CAUSAL:
                j_last = tl.minimum(n_k_blocks - 1, (i * BLOCK_M + BLOCK_M - 1 + DIAG) // BLOCK_N)
            # Row limits rather than `mask & flag`: a masked-off load or store touches no memory.
            n_state_in = tl.where(j > 0, N_Q, 0)  # read O_i, l_i, m_i back: all but the 1st step
            n_state_out = tl.where(j < j_last, N_Q, 0)  # write them: all but the last step
            n_final = tl.where(j == j_last, N_Q, 0)  # write the output: the last step

            # Read Q_i, O_i, l_i, m_i from HBM (at the first step: O = 0, l = 0, m = -inf).
            q = tl.load(q_base + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                        mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
            acc_ptrs = acc_base + rows[:, None] * HEAD_DIM + offs_d[None, :]
            o_i = tl.load(acc_ptrs, mask=rows[:, None] < n_state_in, other=0.0)  # (BLOCK_M, D)
            l_i = tl.load(L + lm_off + rows, mask=rows < n_state_in, other=0.0)  # (BLOCK_M,)
            m_i = tl.load(M + lm_off + rows, mask=rows < n_state_in,
                          other=float("-inf"))  # (BLOCK_M,)

            # S_ij in log2 units, masked (keys past N_k; causal keys after the diagonal)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            keep = col_ok[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + DIAG)
            s = tl.where(keep, s, float("-inf"))  # (BLOCK_M, BLOCK_N)

            # Block statistics. A row with no visible key has m~ = -inf: use 0 inside exp2
            # so that P~ = exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
            m_tilde = tl.max(s, 1)  # (BLOCK_M,)
            p = tl.math.exp2(s - tl.where(m_tilde == float("-inf"), 0.0, m_tilde)[:, None])
            l_tilde = tl.sum(p, 1)  # (BLOCK_M,)

            # Merge with the running (m_i, l_i, O_i) and renormalise (the paper's line 12).
            m_new = tl.maximum(m_i, m_tilde)
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_new_safe)  # weight of the old rows; 0 if m_i = -inf
            beta = tl.math.exp2(m_tilde - m_new_safe)  # weight of this block; 0 if m~ = -inf
            l_new = alpha * l_i + beta * l_tilde
            # l_new = 0 only where no key was seen yet; there the numerator is 0, so O stays 0.
            inv_l = 1.0 / tl.where(l_new > 0.0, l_new, 1.0)
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # (BLOCK_M, D)
            o_new = (o_i * (l_i * alpha)[:, None] + pv * beta[:, None]) * inv_l[:, None]

            # Write O_i, l_i, m_i back to HBM; the last step writes the output instead.
            tl.store(acc_ptrs, o_new, mask=rows[:, None] < n_state_out)
            tl.store(L + lm_off + rows, l_new, mask=rows < n_state_out)
            tl.store(M + lm_off + rows, m_new, mask=rows < n_state_out)
            tl.store(o_base + rows[:, None] * stride_on + offs_d[None, :] * stride_od,
                     o_new.to(Out.dtype.element_ty), mask=rows[:, None] < n_final)
        # The next outer step reads what this one wrote, possibly from other threads of the
        # program: make those stores visible to the whole program first.
        tl.debug_barrier()


# Block sizes (BLOCK_M, BLOCK_N, num_warps) per head dim on a GPU. K_j and V_j stay in
# registers for the whole inner loop, so large head dims get smaller blocks. num_stages=1: the
# loop reads back what it wrote one outer step earlier, and v1 does no software pipelining.
_GPU_CONFIGS = {16: (64, 64, 4), 32: (64, 64, 4), 64: (64, 64, 4), 128: (64, 64, 4),
                256: (32, 32, 4)}
_INTERPRETER_BLOCK = 32  # the interpreter is fastest with few, moderately sized blocks


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {value!r}")
    return value


def block_sizes(head_dim: int, block_m: int | None = None, block_n: int | None = None,
                on_gpu: bool | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) the wrapper picks for this head dim.

    ``on_gpu`` defaults to this machine's mode; pass True to get the GPU's choice on a CPU.
    """
    if head_dim not in _GPU_CONFIGS:
        raise ValueError(f"head dim {head_dim} is not supported; use one of {tuple(_GPU_CONFIGS)}")
    on_gpu = not INTERPRET if on_gpu is None else on_gpu
    if on_gpu:
        bm, bn, warps = _GPU_CONFIGS[head_dim]
    else:
        bm, bn, warps = _INTERPRETER_BLOCK, _INTERPRETER_BLOCK, 4
    bm = bm if block_m is None else _check_block("block_m", block_m)
    bn = bn if block_n is None else _check_block("block_n", block_n)
    return bm, bn, warps


def allocate_buffers(q: torch.Tensor):
    """Output (B, H, N_q, D) in q's dtype and the fp32 scratch O_acc (B·H, N_q, D), l, m (B·H, N_q).

    Tests pass NaN-poisoned buffers to ``_flash_attn_v1_forward``: the kernel must never read a
    scratch value it did not write, nor leave an output element unwritten.
    """
    B, H, N_q, D = q.shape
    return (torch.empty((B, H, N_q, D), dtype=q.dtype, device=q.device),
            torch.empty((B * H, N_q, D), dtype=torch.float32, device=q.device),
            torch.empty((B * H, N_q), dtype=torch.float32, device=q.device),
            torch.empty((B * H, N_q), dtype=torch.float32, device=q.device))


def _flash_attn_v1_forward(q, k, v, causal, sm_scale, block_m=None, block_n=None, buffers=None):
    """The launch, on validated inputs; ``buffers`` as from ``allocate_buffers`` (or None)."""
    B, H, N_q, D = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    bm, bn, warps = block_sizes(D, block_m, block_n)
    out, o_acc, l_buf, m_buf = allocate_buffers(q) if buffers is None else buffers
    grid = (B * H,)  # parallel over batch × heads only: the v1 way
    # The -inf guards leave NumPy nothing to warn about in the interpreter; the launch is quiet
    # like flash_v2's all the same, so that no edge case shows a red box for a value it drops.
    with interpreter_errstate():
        _flash_fwd_v1_kernel[grid](
            q, k, v, out, o_acc, l_buf, m_buf,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            H, H // H_kv, N_q, N_k, sm_scale * LOG2E.value,
            HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
            DOT_PRECISION=dot_precision(q.dtype),
            num_warps=warps, num_stages=1,
        )
    return out


def flash_attn_v1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  sm_scale: float | None = None, *, block_m: int | None = None,
                  block_n: int | None = None) -> torch.Tensor:
    """Attention forward with FlashAttention v1's loop order; returns O (B, H, N_q, D) in q's dtype.

    q (B, H, N_q, D); k, v (B, H_kv, N_k, D) with H a multiple of H_kv. ``causal`` is
    bottom-right aligned. ``block_m``/``block_n`` override the block sizes (for the lesson's
    experiments). Forward only: there is no backward for v1.
    """
    D = check_attention_inputs(q, k, v, head_dims=POW2_HEAD_DIMS)[-1]
    sm_scale = check_sm_scale(sm_scale, D)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    block_sizes(D, block_m, block_n)  # checks the overrides before anything is allocated
    return _flash_attn_v1_forward(q, k, v, causal, sm_scale, block_m, block_n)
