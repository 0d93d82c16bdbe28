"""The variants of attention in one place: which keys a query sees, the change to its scores,
and ``Variant``, the checked value of one call's variants (``check_variants``).

Introduced for notebooks/15_attention_variants.ipynb. The reference
(``course_lib.reference.attention_variants``), the public functions' checks and the block
counts (``iomodel.variants``) read their rules here; the kernels compute the same in Triton
(``kernels.band``: ``_band_bounds``, ``_band_rows``, ``_key_limits``, ``_variant_scores``), and
tests hold each pair together.

Conventions are FlashAttention's (Tri Dao, flash-attention, ``flash_attn_func`` in
``flash_attn/flash_attn_interface.py``, https://github.com/Dao-AILab/flash-attention), so a
user's arguments map one to one:

* Query ``i`` of ``N_q`` sits at key position ``p = i + N_k − N_q``: bottom-right aligned, the
  last query is the last key. ``causal=True`` lets it see the keys ``j <= p``.
* ``window_size=(left, right)`` lets it see the keys ``p − left <= j <= p + right``; −1 leaves
  that side unbounded. ``causal=True`` sets ``right = 0``. ``(-1, -1)`` is full attention.
* ``softcap`` c > 0: the scaled score s becomes ``c · tanh(s / c)`` (Gemma 2's logit soft-capping).
* ``alibi_slopes`` (H,) or (B, H): ``−slope · |p − j|`` is added to the scaled score (Press et
  al., "Train Short, Test Long", 2022, https://arxiv.org/abs/2108.12409, in FlashAttention's
  bottom-right form).
* ``sinks`` (H,): a logit per head that joins the softmax's denominator with no value
  (GPT-OSS's attention sinks).

Every variant is a rule for which key blocks a block of query rows skips, reads in full, or
reads under a mask (``block_kind``), plus a change to the scores. A row that sees no key has
output 0 and log-sum-exp −inf (with a sink: the sink's logit).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FULL = (-1, -1)


def normalize_window(window_size, causal: bool = False) -> tuple[int, int]:
    """``window_size`` as (left, right) ints, −1 for an unbounded side, right = 0 if causal.

    >>> normalize_window((-1, -1), causal=True)
    (-1, 0)
    >>> normalize_window((128, 0))
    (128, 0)
    """
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError(f"window_size must be >= -1 on each side (-1: unbounded), got "
                         f"{tuple(window_size)}")
    return (left, 0 if causal else right)


def key_bounds(rows, n_q: int, n_k: int, window) -> tuple[torch.Tensor, torch.Tensor]:
    """For query rows ``rows`` (a tensor of indices), the first and one past the last key each
    may see, clamped to [0, n_k]: (lo, hi); a row with lo >= hi sees no key."""
    left, right = window
    p = rows + (n_k - n_q)
    lo = torch.clamp(p - left, min=0) if left >= 0 else torch.zeros_like(p)
    hi = torch.clamp(p + right + 1, max=n_k) if right >= 0 else torch.full_like(p, n_k)
    return lo.clamp(max=n_k), hi.clamp(min=0)


def visible_pairs(n_q: int, n_k: int, window=FULL) -> int:
    """How many (query, key) pairs the rows see under ``window``: the useful work of a forward
    (4·d FLOPs a pair), what a throughput "on the visited area" counts."""
    lo, hi = key_bounds(torch.arange(n_q), n_q, n_k, window)
    return int((hi - lo).clamp(min=0).sum())


def visible(n_q: int, n_k: int, window=FULL, device=None) -> torch.Tensor:
    """Boolean (n_q, n_k): True where query i may see key j under ``window`` (normalised)."""
    lo, hi = key_bounds(torch.arange(n_q, device=device), n_q, n_k, window)
    j = torch.arange(n_k, device=device)[None, :]
    return (j >= lo[:, None]) & (j < hi[:, None])


def block_key_range(r0: int, r1: int, n_q: int, n_k: int, window) -> tuple[int, int, int, int]:
    """For the query rows [r0, r1): (lo, full_lo, full_hi, hi). The rows together see keys
    [lo, hi); every row sees every key of [full_lo, full_hi) (empty when full_lo >= full_hi).
    A kernel loads no key outside [lo, hi) and needs no mask inside [full_lo, full_hi)."""
    left, right = window
    first, last = r0 + n_k - n_q, r1 - 1 + n_k - n_q  # key positions of the first and last row
    lo = 0 if left < 0 else max(0, first - left)
    hi = n_k if right < 0 else min(n_k, last + right + 1)
    full_lo = 0 if left < 0 else max(0, last - left)
    full_hi = n_k if right < 0 else min(n_k, first + right + 1)
    if hi <= lo:
        return 0, 0, 0, 0
    return lo, min(max(full_lo, lo), hi), max(min(full_hi, hi), lo), hi


def block_row_range(c0: int, c1: int, n_q: int, n_k: int, window) -> tuple[int, int, int, int]:
    """The transpose of ``block_key_range``, for the backward's dK/dV program that holds the
    keys [c0, c1): (lo, full_lo, full_hi, hi). The rows [lo, hi) together see some of its keys;
    every row of [full_lo, full_hi) sees all of them. Query i sees key j when
    j − right <= p <= j + left, p = i + n_k − n_q."""
    left, right = window
    offset, last = n_k - n_q, min(c1, n_k) - 1  # the block's last real key
    lo = 0 if right < 0 else max(0, c0 - right - offset)
    hi = n_q if left < 0 else min(n_q, last + left - offset + 1)
    full_lo = 0 if right < 0 else max(0, last - right - offset)
    full_hi = n_q if left < 0 else min(n_q, c0 + left - offset + 1)
    if hi <= lo or c0 >= n_k:
        return 0, 0, 0, 0
    return lo, min(max(full_lo, lo), hi), max(min(full_hi, hi), lo), hi


def block_kind(r0: int, r1: int, c0: int, c1: int, n_q: int, n_k: int, window) -> str:
    """What a kernel does with the key block [c0, c1) for the query rows [r0, r1):
    "skipped" (no row sees any of its keys: never loaded), "unmasked" (every row sees every
    key: no mask) or "masked"."""
    lo, full_lo, full_hi, hi = block_key_range(r0, r1, n_q, n_k, window)
    if c1 <= lo or c0 >= hi:
        return "skipped"
    if full_lo <= c0 and c1 <= full_hi:
        return "unmasked"
    return "masked"


def alibi_bias(alibi_slopes: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """−slope · |p − j| for every (query i, key j), p = i + n_k − n_q: (1 or B, H, n_q, n_k) in
    the slopes' dtype, from slopes (H,) or (B, H)."""
    p = torch.arange(n_q, device=alibi_slopes.device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=alibi_slopes.device)[None, :]
    dist = (p - j).abs().to(alibi_slopes.dtype)  # (n_q, n_k)
    slopes = alibi_slopes if alibi_slopes.ndim == 2 else alibi_slopes[None]  # (1 or B, H)
    return -slopes[:, :, None, None] * dist


def variant_scores(s: torch.Tensor, variant) -> torch.Tensor:
    """The scaled scores s = sm_scale·qkᵀ (..., n_q, n_k) as ``variant`` changes them: with a
    softcap c > 0, c·tanh(s / c), then ALiBi's −slope·|p − j| (``alibi_bias``). What the
    kernels compute in Triton (``kernels.band._variant_scores``)."""
    if variant.softcap:
        s = variant.softcap * torch.tanh(s / variant.softcap)
    if variant.alibi_slopes is not None:
        s = s + alibi_bias(variant.alibi_slopes.to(s.dtype), *s.shape[-2:])
    return s


# The public calls' default window: a call that passes this very object has none.
NO_WINDOW = (-1, -1)


class Variant(NamedTuple):
    """The variants of one attention call (lesson 15), checked: what every kernel that serves
    them takes, from the checks to the launch. ``window`` (left, right), −1 for an unbounded
    side (causal is right = 0); ``softcap`` a float, 0.0 for none;
    ``alibi_slopes`` (H,) or (B, H) and ``sinks`` (H,) fp32 tensors, or None."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        """Whether the scores are plain ones (no softcap, ALiBi or sinks): a window then only
        limits which keys a row sees."""
        return self.softcap == 0.0 and self.alibi_slopes is None and self.sinks is None


def check_variants(q, causal, window_size, softcap, alibi_slopes, sinks) -> Variant:
    """The variants' arguments of an attention call on q (B, H, N_q, D), checked: a ``Variant``
    with the window normalised (causal is right = 0) and softcap a float
    (0.0: off). Shapes, dtypes and devices only: no value is read back."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = normalize_window(window_size, causal)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number (0.0: no cap), got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (softcap >= 0 and softcap < float("inf")):
        raise ValueError(f"softcap must be > 0 (or 0.0: no cap) and finite, got {softcap}")
    B, H = q.shape[0], q.shape[1]
    for name, t, shapes in (("alibi_slopes", alibi_slopes, ((H,), (B, H))),
                            ("sinks", sinks, ((H,),))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of float32, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) not in shapes:
            want = " or ".join(str(s).replace(",)", ")") for s in shapes)
            raise ValueError(f"{name} must have shape {want} for q's batch {B} and {H} heads, "
                             f"got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return Variant(window, softcap, alibi_slopes, sinks)
