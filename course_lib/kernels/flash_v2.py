"""FlashAttention-2 forward in Triton: the portable kernel and the public ``flash_attn_v2``.

Introduced in notebooks/08_triton_flash_v2.ipynb (the Hopper variant in notebooks/09_hopper.ipynb,
the backward pass in notebooks/10_backward.ipynb).

What v2 changes against v1 (Dao 2023, "FlashAttention-2", sections 3.1 and 3.2):

1. **Loop order.** Q blocks are outer and parallel: one program owns BLOCK_M query rows and
   streams every K/V block past them. O, l and m live in registers for the whole loop and are
   written to HBM once, instead of being read and written at every step as in v1.
2. **Parallelism.** The grid is (N_q / BLOCK_M, batch · heads), not batch · heads: enough
   programs to fill 132 SMs even at batch 1.
3. **Deferred normalisation.** ``acc`` holds the un-normalised Σ e^{s - m} v; it is divided by
   ``l`` once, at the end. Each step only rescales by α = e^{m_old - m_new}.
4. **exp2.** ``qk_scale = sm_scale · log2(e)`` is folded into one multiply, so every
   exponential is a native ``exp2`` (e^x = 2^{x·log2 e}).
5. **Causal skipping.** Key blocks wholly above the (bottom-right aligned) diagonal are never
   visited; blocks wholly below it run without any mask; only the few blocks that straddle the
   diagonal or the ragged end of the keys pay for masking.
6. **The log-sum-exp is saved** (natural log, fp32): the backward pass recomputes P from it.

Grid order matters for HBM traffic. Q blocks vary fastest, so the programs that re-read one
head's K/V run at the same time and the re-reads hit L2; the heads of a GQA group (query head h
reads K/V head h // (H / H_kv)) are neighbours on the second axis, so the group's K/V is still
in L2 when the next head of the group starts. Measured with Nsight Compute on an H100 at the
FlashAttention paper's Figure 2 shape: with heads varying fastest instead, every re-read went
to DRAM and v2 moved 2.42 GB, 4.5x the 0.54 GB minimum (see course_lib/data/perf_notes.md).

Rows that see no key (bottom-right causal with N_q > N_k) give O = 0 and lse = -inf, as in
``course_lib.reference.attention``.

Versions (side by side, llm.c style), each its own kernel:
  * ``portable`` (this file): plain pointer arithmetic with masks, any stride; runs on every
    GPU Triton supports and in the interpreter.
  * ``hopper`` (flash_v2_hopper.py): TMA tensor descriptors and a pipelining depth autotuned for
    sm_90; chosen automatically on Hopper.

Measured speed (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-22, sixth
sweep, every provider timed in 5 interleaved rounds, median; fp16 forward, B·N = 32k, H·D = 2048,
FLOPs = 4·B·H·N²·D, half for causal; course_lib/data/attention_fwd.json), TFLOP/s:

    D   causal      N   portable   hopper   SDPA FLASH   SDPA cuDNN   best / FLASH
    64  no       4096      391.9    489.2        309.0        431.4           1.58
    64  no      16384      414.2    515.3        313.3        441.8           1.64
    64  yes      4096      346.0    417.1        283.3        401.5           1.47
    64  yes     16384      382.4    468.0        309.7        446.2           1.51
   128  no       4096      444.2    536.2        339.6        575.4           1.58
   128  no      16384      476.0    553.9        347.0        585.0           1.60
   128  yes      4096      415.1    470.9        307.0        506.5           1.53
   128  yes     16384      443.6    553.3        331.4        539.8           1.67

Target >= 1.4x SDPA FLASH at N >= 4k (4k, 8k, 16k): met at all 12 points (1.47-1.67; 8k in the
JSON). The Hopper kernel's last step was the pinned max (flash_v2_hopper.py, notebook 09 section
9): +12% at D 64, +9% at D 128 in paired runs. The fourth sweep, before it and before the row sums
on the tensor cores, met 6 of 12 (1.36-1.48). Single runs of one config vary by up to 5-10% and
SDPA FLASH by up to 10%, hence interleaved rounds. Tried and measured slower
(course_lib/data/hopper_ideas.json, hopper_tiles.json, hopper_pinned.json): a software exp2 on
the FMA units, lazy rescaling, Triton 3.6's warp specialisation, a register cap, the next block's
QK^T issued before the softmax, packed fp16 exp2, a persistent kernel, causal programs
heavy-first across heads, 64 x 128 tiles at D 64.

DRAM traffic at the FlashAttention paper's Figure 2 shape (B 64, H 16, N 1024, d 64): 0.533 GB,
0.985x the minimum of reading Q, K, V and writing O and lse once (Nsight Compute).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE, INTERPRET
from course_lib.kernels._validate import check_attention_inputs, check_sm_scale
from course_lib.reference import LOG2E

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis, which carries batch x heads


@triton.jit
def _softmax_scores(qk, m_i, valid, qk_scale, MASKED: tl.constexpr):
    """The exponentials of one (BLOCK_M, BLOCK_N) score tile: (p, α, m_new).

    ``qk`` holds raw q·k; ``p`` is e^{s - m_new} in the exp2 domain and α = e^{m_old - m_new}
    rescales what was accumulated before. With MASKED, entries where ``valid`` is False count as
    -inf, and a row with no valid entry so far keeps m = -inf (p = α = 0) without producing NaN.
    """
    if MASKED:
        s = tl.where(valid, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row: no NaN
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, m_new


@triton.jit
def _online_softmax_step(qk, m_i, l_i, acc, valid, qk_scale, MASKED: tl.constexpr):
    """One step of the online softmax on a (BLOCK_M, BLOCK_N) score tile.

    Returns (p, m_new, l_new, acc rescaled by α); see ``_softmax_scores`` for p, α and masking.
    """
    p, alpha, m_new = _softmax_scores(qk, m_i, valid, qk_scale, MASKED)
    l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, m_new, l_new, acc


@triton.jit
def _causal_bounds(start_m, N_Q, N_K, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Key range of a Q block: [0, lo_masked) needs no mask, [lo_masked, hi) does.

    Causal is bottom-right aligned: query i sees keys j <= i + N_K - N_Q.
    """
    if CAUSAL:
        offset = N_K - N_Q
        hi = tl.minimum(N_K, start_m + BLOCK_M + offset)  # last key any row of the block sees
        full = tl.maximum(start_m + offset + 1, 0)  # keys every row of the block sees
        lo_masked = tl.minimum((full // BLOCK_N) * BLOCK_N, tl.maximum(hi, 0))
    else:
        hi = N_K
        lo_masked = (N_K // BLOCK_N) * BLOCK_N
    return lo_masked, hi


@triton.jit
def _epilogue(acc, m_i, l_i):
    """Deferred normalisation: O = acc / l once; lse = ln(Σ e^s) = (m + log2 l)·ln 2."""
    empty = l_i == 0.0  # rows that saw no key
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * 0.6931471805599453)
    return o, lse


@triton.jit
def _q_block_program(H, GROUP, CAUSAL: tl.constexpr):
    """Which Q block and head this program owns: (pid_m, pid_bh, b, h, h_kv).

    Q blocks vary fastest (axis 0): a head's K/V stays hot in L2. The heads of a GQA group are
    neighbours on axis 1. Causal grids run the longest rows first, for better load balance at
    the tail of the grid. Shared by the forward kernels and the backward's dQ kernel.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    return pid_m, pid_bh, b, h, h // GROUP


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
               lo, hi, N_K, q_offset, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]  # (BLOCK_N, HEAD_DIM)
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]  # (BLOCK_N, HEAD_DIM)
        if MASKED:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        valid = offs_n[None, :] < N_K
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + q_offset)
        p, m_i, l_i, acc = _online_softmax_step(qk, m_i, l_i, acc, valid, qk_scale, MASKED)
        if MASKED:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _flash_fwd_v2_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    qk_scale, H, GROUP, N_Q, N_K, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_bh, b, h, h_kv = _q_block_program(H, GROUP, CAUSAL)
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=offs_m[:, None] < N_Q, other=0.0)  # (BLOCK_M, HEAD_DIM), stays on chip

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    lo_masked, hi = _causal_bounds(start_m, N_Q, N_K, CAUSAL, BLOCK_M, BLOCK_N)
    q_offset = N_K - N_Q
    # stage 1: key blocks every row sees in full (no mask at all)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                               offs_m, offs_d, 0, lo_masked, N_K, q_offset, qk_scale,
                               BLOCK_N, False, CAUSAL, DOT_PRECISION)
    # stage 2: the diagonal band and the ragged end of the keys (masked)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
                               offs_m, offs_d, lo_masked, hi, N_K, q_offset, qk_scale,
                               BLOCK_N, True, CAUSAL, DOT_PRECISION)

    o, lse = _epilogue(acc, m_i, l_i)
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=offs_m[:, None] < N_Q)
    tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


# --------------------------------------------------------------------------------------------
# Configurations. On a GPU each head dim gets a short curated list that the autotuner times
# once per (head dim, causal, dtype, power-of-two length bucket). The interpreter uses one
# small config: its cost is per program and per op, not per FLOP.
# --------------------------------------------------------------------------------------------
def _cfg(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


PORTABLE_CONFIGS = [_cfg(128, 64, 4, 3), _cfg(128, 128, 8, 3), _cfg(64, 64, 4, 3)]


def keep_config_for_head_dim(configs, named_args, **kwargs):
    """Autotune filter: tiles whose shared memory fits, sized to the head dim.

    HEAD_DIM 256 keeps only 64-row tiles (a 128 x 256 Q tile plus K/V stages overflows the
    228 KB of an H100 SM); HEAD_DIM 128 drops 128 x 128 with 3 stages for the same reason.
    """
    d = named_args["HEAD_DIM"] if "HEAD_DIM" in named_args else kwargs["HEAD_DIM"]
    kept = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if d >= 256 and (bm > 64 or bn > 64):
            continue
        if d == 128 and bn > 64 and c.num_stages > 2:
            continue
        kept.append(c)
    return kept or configs[-1:]


# Autotuning compiles every kept config once per (head dim, causal, dtype, group) and times
# them once per length bucket: worth it for long sequences only. Shorter problems (and the
# first call of every new shape in a test-suite) use the first kept config directly.
AUTOTUNE_MIN_N = 2048
INTERPRETER_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}

_portable_tuned = triton.autotune(
    configs=PORTABLE_CONFIGS,
    key=["N_BUCKET", "HEAD_DIM", "CAUSAL", "DOT_PRECISION", "GROUP"],
    prune_configs_by={"early_config_prune": keep_config_for_head_dim},
)(_flash_fwd_v2_kernel)


def launch(kernel, tuned, configs, keep, grid_of, args, meta, n_bucket, prepare=None):
    """Launch ``kernel`` in one of three ways: interpreter blocks, a fixed config, or autotuned.

    ``grid_of(BLOCK_M)`` gives the grid. ``prepare(blocks)`` readies a fixed config's launch the
    way the autotuner's config pre-hook readies a tuned one (the TMA descriptors' block shapes).
    """
    if not INTERPRET and n_bucket >= AUTOTUNE_MIN_N:
        tuned[lambda m: grid_of(m["BLOCK_M"])](*args, **meta)
        return
    cfg = keep(configs, {}, **meta)[0]
    if INTERPRET:  # the GPU's code path (Q_IN_REGS, ROWSUM_MMA, ...) with small tiles
        blocks, options = {**cfg.kwargs, **INTERPRETER_BLOCKS}, {}
    else:
        blocks, options = cfg.kwargs, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if prepare is not None:
        prepare(blocks)
    with interpreter_errstate():
        kernel[grid_of(blocks["BLOCK_M"])](*args, **meta, **blocks, **options)


def interpreter_errstate():
    """NumPy's floating-point warnings off while the Triton interpreter runs a kernel of ours.

    The interpreter computes with NumPy on every lane, the branch ``tl.where`` discards
    included, and NumPy warns (a red box in a notebook) about values the kernel computes on
    purpose and then drops. Expected here: in ``_epilogue``, log2(0) = -inf for the rows that
    see no key (bottom-right causal with N_q > N_k: l = 0, and their lse is -inf by design);
    in the backward (flash_bwd.py), exp2 overflowing to inf in the scores past the causal
    diagonal before ``tl.where`` sets them to 0 (large ``sm_scale``). What the kernels return
    does not change; on a GPU nothing is computed by NumPy, so this is a no-op there.
    """
    if INTERPRET:
        return np.errstate(divide="ignore", invalid="ignore", over="ignore")
    return contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 (and fp64) inputs get exact dots ("ieee"); TF32 would fail the 2x error rule."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def allocate_outputs(q, out=None):
    """O (B, H, N_q, D) in q's dtype and lse (B, H, N_q) fp32; tests pass NaN-poisoned ``out``."""
    if out is not None:
        return out
    B, H, N_Q, D = q.shape
    return (torch.empty((B, H, N_Q, D), dtype=q.dtype, device=q.device),
            torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device))


def _forward_portable(q, k, v, causal, sm_scale, out=None):
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o, lse = allocate_outputs(q, out)
    args = (q, k, v, o, lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            sm_scale * LOG2E, H, H // H_KV, N_Q, N_K, triton.next_power_of_2(max(N_Q, N_K)))
    meta = {"HEAD_DIM": D, "CAUSAL": bool(causal), "DOT_PRECISION": dot_precision(q.dtype)}
    launch(_flash_fwd_v2_kernel, _portable_tuned, PORTABLE_CONFIGS, keep_config_for_head_dim,
           lambda bm: (triton.cdiv(N_Q, bm), B * H), args, meta, args[-1])
    return o, lse


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------
def _available_impls() -> tuple[str, ...]:
    if DEVICE == "cpu":
        return ("portable", "hopper")  # the interpreter runs both kernels
    if torch.cuda.get_device_capability()[0] >= 9:
        return ("portable", "hopper")
    return ("portable",)


IMPLS = _available_impls()


def best_impl(q: torch.Tensor, k: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> str:
    """The implementation ``impl=None`` picks, from the measured sweeps on an H100.

    TMA pays at HEAD_DIM 128 (481 vs 449 TFLOP/s at N = 4k) and, with 64-wide key tiles and Q
    in registers, at HEAD_DIM 64 (N 4k: 420 vs 402; causal: 367 vs 354). Smaller head dims were not
    measured and keep the portable kernel (course_lib/data/perf_notes.md).
    """
    if DEVICE == "cuda" and "hopper" in IMPLS and q.shape[-1] >= 64:
        from course_lib.kernels.flash_v2_hopper import tma_compatible

        if all(tma_compatible(t) for t in (q, k, v) if t is not None):
            return "hopper"
    return "portable"


def _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl=None, out=None):
    """Forward on validated inputs: returns (o in q's dtype, lse fp32 natural log).

    ``out`` = (o, lse) preallocated (contiguous) lets tests poison the outputs with NaN first.
    """
    impl = impl or best_impl(q, k, v)
    if impl == "portable":
        return _forward_portable(q, k, v, causal, sm_scale, out)
    if impl == "hopper":
        from course_lib.kernels.flash_v2_hopper import forward_hopper

        return forward_hopper(q, k, v, causal, sm_scale, out)
    raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")


def flash_attn_v2(q, k, v, causal=False, sm_scale=None, return_lse=False, impl=None):
    """FlashAttention-2: softmax(sm_scale·QKᵀ [+ causal mask])·V, fused in one Triton kernel.

    q (B, H, N_q, D); k, v (B, H_kv, N_k, D) with H a multiple of H_kv. ``causal`` is
    bottom-right aligned. Returns O (B, H, N_q, D) in q's dtype, and with ``return_lse`` also the
    natural-log log-sum-exp (B, H, N_q) in fp32. ``impl`` picks a kernel from ``IMPLS`` (None:
    the fastest for this GPU). Differentiable when an input requires grad.
    """
    D = check_attention_inputs(q, k, v)[-1]
    sm_scale = check_sm_scale(sm_scale, D)
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:
        raise ValueError(f"q's batch x heads = {q.shape[0] * q.shape[1]} exceeds {MAX_GRID_Y}, "
                         "the CUDA grid's limit on the axis that carries them; split the batch")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        from course_lib.kernels.flash_bwd import FlashAttnV2Function

        return FlashAttnV2Function.apply(q, k, v, causal, sm_scale, return_lse, impl)
    o, lse = _flash_attn_v2_forward(q, k, v, causal, sm_scale, impl)
    return (o, lse) if return_lse else o
