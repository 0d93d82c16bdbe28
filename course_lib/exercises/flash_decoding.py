"""The split kernel's loop: the main exercise of notebooks/12_flash_decoding.ipynb.

The student writes the loop body of Flash-Decoding's split kernel in a minimal form (N_q = 1, a
contiguous fp32 cache, no variants): load a tile of K and V under the split's mask, the base-2
scores with −∞ past the end, lesson 08's online-softmax update (running max, rescale of l and
acc), and after the loop the split's normalised ``o_s`` and its natural-log ``lse_s``, which
the merge of section 1 weighs with. The skeleton gives the split's bounds, the GQA group's rows
and their q, the state and the stores of o_s.

The checker launches the kernel, one program per (split, sequence·K/V head), on awkward cases
(a tile past a sequence's end, NaN in the cache past every length, splits without keys, a cache
that ends at the last key) and compares o_s and lse_s with the closed form in float64. A wrong
attempt is diagnosed (``course_lib.exercises.diagnose``): its outputs are set against what the
loop gives with each classic mistake (acc not rescaled, no −∞ past the end, tl.exp on base-2
scores, lse_s in base 2 or never stored, 0/0 in an empty split, NaN loaded past the length).
The reference solution is ``_split_kv_solution``; the library's kernel,
``course_lib.kernels.decode._decode_split_kernel``, is shown after the check.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib.exercises import (
    KERNEL_NUDGES,
    Exercise,
    Mistake,
    check_kernel,
    poisoned,
    register,
    sandbox,
)
from course_lib.exercises.diagnose import diagnosed, same
from course_lib.exercises.flash_v2 import EXACT_DOTS, LOG2E, TOL, kernel_variant

LN2 = math.log(2.0)
BLOCK = 16  # BLOCK_M (the group's rows, padded) and BLOCK_N (keys a tile): tl.dot needs >= 16


# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def split_kv_kernel(Q, K, V, SEQLENS, O_PART, LSE_PART, qk_scale, H_KV, N_MAX, NUM_SPLITS,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    split = tl.program_id(0)  # which split of the keys
    bg = tl.program_id(1)  # b * H_KV + g: sequence b, K/V head g
    b = bg // H_KV
    g = bg % H_KV
    seqlen = tl.load(SEQLENS + b)
    tiles = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), NUM_SPLITS)  # whole tiles of keys per split
    start = split * tiles * BLOCK_N  # this split's keys are [start, end): maybe none
    end = tl.minimum(start + tiles * BLOCK_N, seqlen)
    offs_m = tl.arange(0, BLOCK_M)  # rows: the GROUP query heads of K/V head g, padded
    row_ok = offs_m < GROUP
    head = g * GROUP + offs_m  # the query head of each row
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (b * H_KV * GROUP + head)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
    k_base = K + bg * N_MAX * HEAD_DIM  # key n of (b, g) starts at k_base + n * HEAD_DIM
    v_base = V + bg * N_MAX * HEAD_DIM  # value n likewise
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    for start_n in range(start, end, BLOCK_N):
        ...  # TODO: the loop body: K and V tiles, base-2 scores, the online-softmax update
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l_i is 0 in a split without keys
    o = ...  # TODO: the split's normalised o_s (zeros for a split without keys)
    lse = ...  # TODO: the split's lse_s, a natural log (-inf for a split without keys)
    part = (b * H_KV * GROUP + head) * NUM_SPLITS + split  # (b, head, split) of each row
    tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
    ...  # TODO: store lse at LSE_PART + part, for the rows that exist


# --- the reference and the mistakes students make ------------------------------------------
@triton.jit
def _split_kv_solution(Q, K, V, SEQLENS, O_PART, LSE_PART, qk_scale, H_KV, N_MAX, NUM_SPLITS,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    split = tl.program_id(0)  # which split of the keys
    bg = tl.program_id(1)  # b * H_KV + g: sequence b, K/V head g
    b = bg // H_KV
    g = bg % H_KV
    seqlen = tl.load(SEQLENS + b)
    tiles = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), NUM_SPLITS)  # whole tiles of keys per split
    start = split * tiles * BLOCK_N  # this split's keys are [start, end): maybe none
    end = tl.minimum(start + tiles * BLOCK_N, seqlen)
    offs_m = tl.arange(0, BLOCK_M)  # rows: the GROUP query heads of K/V head g, padded
    row_ok = offs_m < GROUP
    head = g * GROUP + offs_m  # the query head of each row
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (b * H_KV * GROUP + head)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
    k_base = K + bg * N_MAX * HEAD_DIM  # key n of (b, g) starts at k_base + n * HEAD_DIM
    v_base = V + bg * N_MAX * HEAD_DIM  # value n likewise
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # this tile's keys
        n_ok = offs_n < end  # the split's keys: never past the sequence's length
        kv = offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # (BLOCK_N, HEAD_DIM) offsets
        k = tl.load(k_base + kv, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_base + kv, mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # base-2 scores (BLOCK_M, BLOCK_N)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l_i is 0 in a split without keys
    o = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    part = (b * H_KV * GROUP + head) * NUM_SPLITS + split  # (b, head, split) of each row
    tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(LSE_PART + part, lse, mask=row_ok)


_LSE_LINE = "(m_i + tl.math.log2(l_safe)) * 0.6931471805599453"
_WRONG = {
    "no_rescale": kernel_variant(_split_kv_solution, (
        "acc = acc * alpha[:, None] + tl.dot(p, v)", "acc = acc + tl.dot(p, v)")),
    "no_mask": kernel_variant(_split_kv_solution, (
        "        s = tl.where(n_ok[None, :], s, float(\"-inf\"))\n", "")),
    "exp": kernel_variant(_split_kv_solution,
                          ("tl.math.exp2(m_i - m_new)", "tl.exp(m_i - m_new)"),
                          ("tl.math.exp2(s - m_new[:, None])", "tl.exp(s - m_new[:, None])")),
    "no_scale": kernel_variant(_split_kv_solution, (
        "s = tl.dot(q, tl.trans(k)) * qk_scale", "s = tl.dot(q, tl.trans(k))")),
    "lse_base2": kernel_variant(_split_kv_solution, (_LSE_LINE, "m_i + tl.math.log2(l_safe)")),
    "lse_unstored": kernel_variant(_split_kv_solution, (
        "tl.store(LSE_PART + part, lse, mask=row_ok)", "pass")),
    "o_by_l": kernel_variant(_split_kv_solution, (
        "o = acc / l_safe[:, None]", "o = acc / l_i[:, None]")),
    "loads_unmasked": kernel_variant(_split_kv_solution,
                                     ("tl.load(k_base + kv, mask=n_ok[:, None], other=0.0)",
                                      "tl.load(k_base + kv)"),
                                     ("tl.load(v_base + kv, mask=n_ok[:, None], other=0.0)",
                                      "tl.load(v_base + kv)")),
}


def _split_in_torch(q, k, v, lens, num_splits, group, label=""):
    return _split_spec(q, k, v, lens, num_splits, group)


# --- the cases, the launch, the spec ---------------------------------------------------------
def _bounds(seqlen: int, num_splits: int, block_n: int = BLOCK) -> list[tuple[int, int]]:
    """The skeleton's [start, end) of every split: runs of whole tiles, the last at seqlen."""
    tiles = math.ceil(math.ceil(seqlen / block_n) / num_splits)
    return [(s * tiles * block_n, min(s * tiles * block_n + tiles * block_n, seqlen))
            for s in range(num_splits)]


def _case(seed, B, H_kv, group, D, n_max, lens, num_splits, label, grow=False):
    """q (B, H, D), a cache (B, H_kv, n_max, D) with NaN past every length, fp32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * group, D, generator=gen)
    k = torch.randn(B, H_kv, n_max, D, generator=gen)
    v = torch.randn(B, H_kv, n_max, D, generator=gen)
    if grow:  # keys drift toward the group's queries: the running max grows tile after tile
        mean_q = q.view(B, H_kv, group, D).mean(2, keepdim=True)  # (B, H_kv, 1, D)
        k = k + 3 * torch.linspace(0, 1, n_max)[None, None, :, None] * mean_q
    for b, n in enumerate(lens):  # past a sequence's length the cache holds whatever: NaN
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v, torch.tensor(lens, dtype=torch.int32), num_splits, group, label


def _split_cases():
    return [
        _case(0, 1, 1, 4, 16, 64, [64], 1,
              "1 sequence of 64 keys (4 tiles), 1 K/V head, a group of 4 query heads, D = 16, "
              "1 split"),
        _case(1, 2, 2, 2, 32, 80, [80, 37], 3,
              "2 sequences of 80 and 37 keys, 2 K/V heads, groups of 2, D = 32, 3 splits: the "
              "last split of the second ends inside a tile; the cache holds NaN past each "
              "length"),
        _case(2, 1, 1, 5, 16, 96, [96], 2,
              "96 keys drifting toward the queries (the max grows tile after tile), a group "
              "of 5, 2 splits of 3 tiles", grow=True),
        _case(3, 3, 1, 3, 16, 20, [1, 0, 20], 4,
              "3 sequences of 1, 0 and 20 keys, 4 splits: splits without keys (o_s = 0, "
              "lse_s = −inf); the cache ends at the last key"),
    ]


def prepare_split_kv(q, k, v, lens, num_splits, group, label=""):
    """One launch: a program per (split, sequence·K/V head); o_s and lse_s poisoned."""
    B, H, D = q.shape
    H_kv, n_max = k.shape[1], k.shape[2]
    o_part = poisoned(B, H, num_splits, D, like=q)
    lse_part = poisoned(B, H, num_splits, like=q)
    args = dict(Q=q, K=k, V=v, SEQLENS=lens, O_PART=o_part, LSE_PART=lse_part,
                qk_scale=D ** -0.5 * LOG2E, H_KV=H_kv, N_MAX=n_max, NUM_SPLITS=num_splits,
                GROUP=group, HEAD_DIM=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, **EXACT_DOTS)
    return (num_splits, B * H_kv), args, (o_part, lse_part)


def _split_spec(q, k, v, lens, num_splits, group, label=""):
    """Each split's softmax over its own keys, in float64: (o_s (B, H, S, D), lse_s (B, H, S))
    with o_s = 0 and lse_s = −inf for a split without keys."""
    q, k, v = (t.double() for t in (q, k, v))
    B, H, D = q.shape
    o = torch.zeros(B, H, num_splits, D, dtype=torch.float64)
    lse = torch.full((B, H, num_splits), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        for s, (lo, hi) in enumerate(_bounds(n, num_splits)):
            if lo >= hi:
                continue
            kv_head = torch.arange(H) // group
            scores = torch.einsum("hd,hnd->hn", q[b], k[b, kv_head, lo:hi]) * D ** -0.5
            lse[b, :, s] = torch.logsumexp(scores, -1)
            p = torch.exp(scores - lse[b, :, s, None])
            o[b, :, s] = torch.einsum("hn,hnd->hd", p, v[b, kv_head, lo:hi])
    return o, lse


# --- the diagnosis: what the loop gives with each classic mistake ------------------------------
def _loop(q, k, v, lens, num_splits, group, mistake):
    """o_s as the kernel's loop computes it, tile by tile in float64, with ``mistake``:
    "no_rescale" (acc not rescaled), "no_mask" (keys past the end scored 0, their K and V
    loaded as 0), "exp" (e^x on base-2 scores) or "no_scale" (q·k without qk_scale)."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    B, H, D = q.shape
    qk_scale = 1.0 if mistake == "no_scale" else D ** -0.5 * LOG2E
    exp = np.exp if mistake == "exp" else np.exp2
    o = np.zeros((B, H, num_splits, D))
    for b, n in enumerate(lens.tolist()):
        for s, (lo, hi) in enumerate(_bounds(n, num_splits)):
            for h in range(H):
                m, l, acc = -np.inf, 0.0, np.zeros(D)
                for t in range(lo, hi, BLOCK):
                    ok = np.arange(t, t + BLOCK) < hi  # a prefix of the tile
                    kk, vv = np.zeros((BLOCK, D)), np.zeros((BLOCK, D))  # masked loads: 0
                    kk[ok], vv[ok] = k[b, h // group, t:hi][:BLOCK], v[b, h // group, t:hi][:BLOCK]
                    sc = kk @ q[b, h] * qk_scale
                    if mistake != "no_mask":
                        sc = np.where(ok, sc, -np.inf)
                    m_new = max(m, sc.max())
                    alpha, p = exp(m - m_new), exp(sc - m_new)
                    l = l * alpha + p.sum()
                    acc = (acc if mistake == "no_rescale" else acc * alpha) + p @ vv
                    m = m_new
                o[b, h, s] = acc / l if l > 0 else 0.0
    return o


def _merged(o_part, lse_part):
    """Section 1's merge of every (b, head)'s splits: (B, H, D)."""
    top = np.max(np.where(np.isfinite(lse_part), lse_part, -np.inf), axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(all="ignore"):
        w = np.where(np.isneginf(lse_part), 0.0, np.exp(lse_part - top))
        total = w.sum(-1, keepdims=True)
        return (w[..., None] * np.where(np.isneginf(lse_part)[..., None], 0.0, o_part)).sum(-2) \
            / np.where(total > 0, total, 1.0)


_LOOKS_LIKE = {
    "no_rescale": "o_s is what the loop gives when acc is not rescaled by α: l_i shrank by "
                  "2^(m_old − m_new) when the max grew, acc did not, so the earlier tiles keep "
                  "a weight too large by that factor.",
    "no_mask": "o_s is what the loop gives when the keys past the end got a weight: their K "
               "row loads as 0, so their score is 0 instead of −∞, and 2^(0 − m_i) joins l_i "
               "(their V is 0: o_s shrinks). Only a split whose last tile hangs over the "
               "sequence's end shows it.",
    "exp": "o_s is the softmax of the scores times log2(e) = 1.4427: tl.exp on base-2 scores. "
           "qk_scale already holds log2(e), so the exponentials are powers of 2.",
    "no_scale": "o_s is the softmax of q·k without qk_scale: the scores must be scaled by "
                "sm_scale (and log2(e), for base 2) before the max and the exponentials.",
}


def _diagnose_split(kernel, message: str) -> str | None:
    """Run the cases again in the interpreter (up to one that leaves its tensors or raises);
    match the first wrong one's outputs."""
    if "out of bounds" in message or "raised" in message:
        return None
    runs = []  # (case, got o_s, got lse_s, expected o_s, expected lse_s)
    for case in _split_cases():
        grid, args, (o_t, lse_t) = prepare_split_kv(*case)
        tensors = {n: t for n, t in args.items() if isinstance(t, torch.Tensor)}
        try:
            if sandbox.run(kernel, grid, args, tensors):
                break  # out of bounds: the cases before it are still evidence
        except Exception:  # the check's message already says what the kernel raised
            break
        runs.append((case, o_t.double().numpy(), lse_t.double().numpy(),
                     *(t.numpy() for t in _split_spec(*case))))
    wrong = [r for r in runs if not (same(r[1], r[3]) and same(r[2], r[4]))]
    return _classify(wrong[0], runs) if wrong else None


def _classify(run, runs) -> str | None:
    case, got_o, got_lse, want_o, want_lse = run
    empty = np.isneginf(want_lse)  # (B, H, S): the splits without keys
    o_nan = np.isnan(got_o).any(-1)
    if o_nan.any():
        if not (o_nan & ~empty).any():
            return ("o_s is NaN in the splits without keys: there l_i = 0 and acc = 0, and 0/0 "
                    "is NaN. Divide by l_safe, the skeleton's l_i with those zeros made 1.")
        return ("NaN in o_s of splits that hold keys: a K or V row past the sequence's length "
                "was loaded (the checker's cache holds NaN there, as a real cache holds "
                "whatever it held before), and 0 · NaN is NaN even where p = 0. Mask the loads.")
    if same(got_o, want_o):
        if np.isnan(got_lse).all():
            return ("o_s is right, but lse_s was never written (LSE_PART still holds the "
                    "checker's NaN): the merge has nothing to weigh the splits with.")
        base = (" it is in base 2 (log₂ of the split's Σ e^(s_j)), and the merge weighs with "
                "natural logs, e^(lse_s − lse)." if same(got_lse, want_lse / LN2) else "")
        merged = []  # the merge of section 1 on your partial results, case by case
        for n, (c, o, lse, w_o, w_lse) in enumerate(runs):
            if same(o, w_o) and np.isfinite(lse[~np.isneginf(w_lse)]).all():
                off = np.abs(_merged(o, lse) - _merged(w_o, w_lse)).max()
                merged.append(f"case {n} ({c[4]} split{'s' * (c[4] > 1)}) "
                              + ("right" if off < 1e-4 else f"off by {off:.2g}"))
        return (f"o_s is right and lse_s is not:{base} With one split nobody notices: o_s is "
                f"the answer. With more, the merge weighs the splits wrongly. Your partial "
                f"results merged: {', '.join(merged)}.")
    for mistake, why in _LOOKS_LIKE.items():
        if same(got_o[~empty], _loop(*case[:6], mistake)[~empty]):
            return why
    return None


SPLIT_HINTS = (
    "a tile holds the BLOCK_N keys from start_n on; the ones at or past `end` are not this "
    "split's. K and V tiles are (BLOCK_N, HEAD_DIM): key n's row starts at k_base + n·HEAD_DIM.",
    "the scores are q·kᵀ, (BLOCK_M, BLOCK_N), times qk_scale: base-2 logits. A key outside "
    "the split must weigh nothing: its score is −∞ (tl.where), whatever its masked load gave.",
    "then lesson 08's step: the new running max of each row; α, how much what was summed so "
    "far shrinks; p with tl.math.exp2; l_i and acc both rescaled by α before this tile's share "
    "is added (acc's share is a tl.dot).",
    "after the loop: o_s is acc over l (l_safe, for the splits without keys). m_i and l_i are "
    "in base 2: log₂ Σ e^(s_j) = m_i + log₂ l_i, and the merge wants the natural log. A split "
    "without keys stores −∞.",
)
SPLIT_NUDGES = {
    "lse_s: ": "o_s is right, lse_s is not: is it stored, and is it a natural log?",
    "NaN": "a NaN where a number belongs: a row past the sequence's length loaded without its "
           "mask (the cache holds NaN there), or 0/0 in a split without keys.",
}


def check_split_kv(kernel, show: bool = True):
    """``kernel``: your ``@triton.jit`` split kernel; one program per (split, sequence·K/V
    head), its (o_s, lse_s) against each split's softmax in float64."""
    result = check_kernel("split_kv", kernel, prepare_split_kv, _split_spec, _split_cases(),
                          show=False, describe=lambda c: c[-1], **TOL)
    for i, output in enumerate(("o_s", "lse_s")):  # name the outputs _compare numbers
        result.message = result.message.replace(f": item {i}: ", f": {output}: ")
    return diagnosed("split_kv", result, lambda msg: _diagnose_split(kernel, msg), SPLIT_HINTS,
                     {**SPLIT_NUDGES, **KERNEL_NUDGES}, show)


register(Exercise(
    name="split_kv", lesson="12_flash_decoding", kind="triton",
    writes="the split kernel's loop body (masked K/V tiles, base-2 scores, the online-softmax "
           "update), then o_s, its natural-log lse_s and the store of lse_s",
    lines=16, check=check_split_kv, solution=_split_kv_solution, stub=split_kv_kernel,
    extra=(prepare_split_kv,),
    mistakes=(Mistake("acc not rescaled when the max grows", _WRONG["no_rescale"],
                      "acc is not rescaled"),
              Mistake("no −inf for the keys past the end", _WRONG["no_mask"],
                      "keys past the end got a weight"),
              Mistake("tl.exp on the base-2 scores", _WRONG["exp"], "times log2(e)"),
              Mistake("the scores not scaled by qk_scale", _WRONG["no_scale"],
                      "without qk_scale"),
              Mistake("lse_s in base 2 (× ln 2 forgotten)", _WRONG["lse_base2"], "in base 2"),
              Mistake("lse_s never stored", _WRONG["lse_unstored"], "never written"),
              Mistake("o_s = acc / l_i: 0/0 in a split without keys", _WRONG["o_by_l"],
                      "0/0"),
              Mistake("K and V loaded without their mask", _WRONG["loads_unmasked"],
                      "past the sequence's length was loaded"),
              Mistake("an answer in PyTorch, no kernel", _split_in_torch, "@triton.jit kernel")),
    hints=SPLIT_HINTS))
