"""What the FlashAttention-2 kernels share: the online softmax in base 2 (``_softmax_scores``,
``_online_softmax_step``, ``_fresh_state``, ``_epilogue``), a Q block's keys and program
(``_causal_bounds``, ``_q_block_program``), masks for ragged rows and padded head dims
(``_tile_mask``, ``_load_tile``), the backward's first step (``_bwd_preprocess_kernel``) and
``launch``: a config from the kernel's table (or an autotuner's), launched or bound.

Introduced in notebooks/08_triton_flash_v2.ipynb. Imported by the portable forward
(``flash_v2.py``), the Hopper forward (``flash_v2_hopper.py``) and the backwards, so that no
kernel file imports another's ``@triton.jit`` code.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib._device import INTERPRET
from course_lib._launch import bind

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis, which carries batch x heads
# log2(e) and ln(2), the kernels' change of base (exp2 and log2 are one instruction each). A
# tl.constexpr global is what @triton.jit code may read; host code takes ``LOG2E.value``.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _softmax_scores(qk, m_i, valid, qk_scale, MASKED: tl.constexpr):
    """The exponentials of one (BLOCK_M, BLOCK_N) tile of raw q·k: (p, α, m_new). ``p`` is
    e^{s - m_new} in the exp2 domain; α = e^{m_old - m_new} rescales what was accumulated before.
    With MASKED, entries where ``valid`` is False count as -inf, and a row with no valid entry so
    far keeps m = -inf (p = α = 0) without producing NaN."""
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
    """One step of the online softmax on a score tile: (p, m_new, l_new, acc rescaled by α),
    p, α and the mask as in ``_softmax_scores``."""
    p, alpha, m_new = _softmax_scores(qk, m_i, valid, qk_scale, MASKED)
    l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, m_new, l_new, acc


@triton.jit
def _causal_bounds(start_m, N_Q, N_K, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Key range of a Q block: [0, lo_masked) needs no mask, [lo_masked, hi) does. Causal is
    bottom-right aligned: query i sees keys j <= i + N_K - N_Q."""
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
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2)
    return o, lse


# width of the ones tile of ROWSUM_MMA (the Hopper kernels): the narrowest tl.dot takes
ROWSUM_COLS = tl.constexpr(16)


@triton.jit
def _fresh_state(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ROWSUM_MMA: tl.constexpr):
    """The online softmax's start: acc = 0, m = -inf, l = 0 (with ROWSUM_MMA a
    (BLOCK_M, ROWSUM_COLS) tile whose columns all hold the row sums)."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if ROWSUM_MMA:
        l_i = tl.zeros([BLOCK_M, ROWSUM_COLS], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return acc, m_i, l_i


@triton.jit
def _q_block_program(H, GROUP, CAUSAL: tl.constexpr):
    """Which Q block and head this program owns: (pid_m, pid_bh, b, h, h_kv). Q blocks vary
    fastest (axis 0), so a head's K/V stays hot in L2; a GQA group's heads are neighbours on axis
    1. Causal grids run the longest rows first, for a better balanced tail."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    return pid_m, pid_bh, b, h, h // GROUP


@triton.jit
def _tile_mask(rows_ok, cols_ok, COLS: tl.constexpr):
    """``rows_ok``, and with COLS also ``cols_ok`` (the columns of a padded head dim)."""
    if COLS:
        rows_ok = rows_ok & cols_ok
    return rows_ok


@triton.jit
def _load_tile(ptrs, rows_ok, cols_ok, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Load a tile with 0 where a row is past the end (ROWS) or a column is head-dim padding
    (COLS); with neither, a load without a mask, the code a power-of-two D always had."""
    if ROWS:
        x = tl.load(ptrs, mask=_tile_mask(rows_ok, cols_ok, COLS), other=0.0)
    elif COLS:
        x = tl.load(ptrs, mask=cols_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _bwd_preprocess_kernel(O, DO, LSE, Delta, LSE2, N_Q, H, stride_b, stride_h, stride_m,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO ∘ O) and lse₂ = lse · log2 e for BLOCK_M rows of one (batch, head).
    O and DO share strides counted in rows of HEAD_DIM elements (an element stride divided by
    HEAD_DIM, so every address is a multiple of HEAD_DIM and a head dim like 40 keeps 16-byte
    loads): row r of (b, h) starts at element (b·stride_b + h·stride_h + r·stride_m)·HEAD_DIM.
    (B, H, N, D) contiguous is (H·N, N, 1); packed (total, H, D) is B = 1 and (0, 1, H). LSE,
    Delta and LSE2 are (B·H, N_Q) contiguous."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    HEAD_DIM_PAD: tl.constexpr = triton.next_power_of_2(HEAD_DIM)  # tl.arange's power of two
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + offs_i
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_m = offs_m < N_Q
    d_ok = offs_d[None, :] < HEAD_DIM  # with PAD_D: the padding loads as 0, adds 0 to delta
    acc_ty = Delta.dtype.element_ty  # fp32 (fp64 only for gradcheck in the interpreter)
    # the block's first row in int64, the rows within it in int32 (packed rows span all tokens)
    row0 = ((pid_bh // H).to(tl.int64) * stride_b + (pid_bh % H).to(tl.int64) * stride_h
            + (pid_m * BLOCK_M).to(tl.int64) * stride_m)
    ptrs = offs_i[:, None] * (stride_m * HEAD_DIM) + offs_d[None, :]  # (BLOCK_M, HEAD_DIM_PAD)
    m_ok = _tile_mask(mask_m[:, None], d_ok, PAD_D)
    o = tl.load(O + row0 * HEAD_DIM + ptrs, mask=m_ok, other=0.0).to(acc_ty)
    do = tl.load(DO + row0 * HEAD_DIM + ptrs, mask=m_ok, other=0.0).to(acc_ty)
    delta = tl.sum(o * do, axis=1)  # (BLOCK_M,)
    row = pid_bh.to(tl.int64) * N_Q + offs_m
    lse = tl.load(LSE + row, mask=mask_m, other=0.0).to(acc_ty)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(Delta + row, delta, mask=mask_m)
    tl.store(LSE2 + row, lse2, mask=mask_m)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code, without its per-call wrapper (about 2 µs of host time)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for host code, without its per-call wrapper."""
    return 1 << max(0, n - 1).bit_length()


# Autotuning compiles every candidate once per (head dim, causal, dtype, group) and times them
# once per length bucket: worth it for long sequences only. Shorter ones take the table's config.
AUTOTUNE_MIN_N = 2048
INTERPRETER_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 16}


def launch(kernel, grid_of, args, meta, config, tuned=None, prepare=None, free: int = 0):
    """Launch ``kernel`` with ``config`` (a ``triton.Config`` from the kernel's table) on the
    grid ``grid_of(BLOCK_M)``. ``tuned``: an autotuner that picks the config instead, on a GPU.
    ``prepare(blocks)`` readies the launch for the blocks (the TMA descriptors' block shapes).
    The interpreter runs ``INTERPRETER_BLOCKS``. ``free`` > 0: return the launch bound to every
    argument but the first ``free`` addresses (``course_lib._launch.bind``), or None."""
    if tuned is not None and not INTERPRET:
        tuned[lambda m: grid_of(m["BLOCK_M"])](*args, **meta)
        if not free:
            return None
        config = tuned.best_config  # and launch it once more, bound (the same result)
    if INTERPRET:
        blocks, options = {**config.kwargs, **INTERPRETER_BLOCKS}, {}
    else:
        blocks, options = config.kwargs, {"num_warps": config.num_warps,
                                          "num_stages": config.num_stages}
    if prepare is not None:
        prepare(blocks)
    with interpreter_errstate():  # (a no-op on a GPU)
        return bind(free or None, kernel, grid_of(blocks["BLOCK_M"]), *args, **meta, **blocks,
                    **options)


def aligned(*tensors) -> bool:
    """Whether every address is 16-byte aligned, as a bound launch's compiled kernel assumes."""
    return not any(t.data_ptr() & 15 for t in tensors)


def interpreter_errstate():
    """NumPy's floating-point warnings off while the Triton interpreter runs a kernel of ours:
    it computes every lane, the branch ``tl.where`` discards included (log2(0) in ``_epilogue``,
    exp2 overflowing outside the backward's mask). A no-op on a GPU."""
    if INTERPRET:
        return np.errstate(divide="ignore", invalid="ignore", over="ignore")
    return contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 (and fp64) inputs get exact dots ("ieee"); TF32 would fail the 2x error rule."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def empty_output(q, empty=None):
    """O's buffer, shape (B, H, N_q, D) in q's dtype. A q that is a (B, N_q, H, D) tensor seen
    through ``transpose(1, 2)`` (how most models hold it) gets an O of that layout, so the model's
    next step copies nothing (as with SDPA); any other q a contiguous O. ``empty``: the allocator
    (default ``torch.empty``; tests poison the buffer)."""
    empty = empty or torch.empty
    B, H, N_Q, D = q.shape
    if q.stride() == (N_Q * H * D, D, H * D, 1) and H > 1 and N_Q > 1:
        return empty((B, N_Q, H, D), device=q.device, dtype=q.dtype).transpose(1, 2)
    return empty((B, H, N_Q, D), device=q.device, dtype=q.dtype)


def empty_like_is_output(q) -> bool:
    """Whether ``torch.empty_like(q)`` lays O out as ``empty_output(q)`` does (the same stride
    wherever a dim has more than one element): where it does, the fast paths allocate O with
    it, which parses no shape, dtype or device. Asked of a q on the meta device: no memory."""
    q = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device="meta")
    o, like = empty_output(q), torch.empty_like(q)
    return all(n == 1 or a == b for n, a, b in zip(o.shape, o.stride(), like.stride()))


def call_key(q, k, v, sm_scale) -> tuple:
    """What an attention call's checks (``course_lib.validate``) and launch read: a call with a
    checked call's key passes the same checks. Shapes, strides, dtypes, devices, and the scale
    with its type (True equals 1.0 but is no scale); AttributeError for a non-tensor."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
            v.dtype, q.get_device(), k.get_device(), v.get_device(), type(sm_scale), sm_scale)


def allocate_outputs(q, out=None, lse=True):
    """O (B, H, N_q, D) in q's dtype and layout (``empty_output``) and lse (B, H, N_q) fp32
    (None with ``lse=False``: a kernel told not to store it); tests pass NaN-poisoned ``out``."""
    if out is not None:
        return out
    return empty_output(q), (q.new_empty(q.shape[:3], dtype=torch.float32) if lse else None)
