"""Which forward kernel runs a call: the portable one, or the Hopper (TMA) one.

Introduced in notebooks/09_hopper.ipynb. One rule, ``best_impl``, serves the dense kernels
(``flash_v2``, ``flash_v2_hopper``) and those of lesson 15's variants (``flash_variants``,
``flash_variants_hopper``).
"""
from __future__ import annotations

import torch

from course_lib._device import DEVICE
from course_lib.kernels.flash_v2_hopper import tma_compatible

# The interpreter runs both kernels; a GPU runs the Hopper one from sm_90 on.
IMPLS = (("portable", "hopper")
         if DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9 else ("portable",))

# The Hopper kernel from this much work on: B·H·N_q·N_k query-key pairs (see best_impl).
HOPPER_MIN_PAIRS = 1 << 28


def check_impl(impl) -> None:
    """ValueError unless ``impl`` is None (``best_impl`` picks) or one of ``IMPLS``."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")


def best_impl(q: torch.Tensor, k: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> str:
    """The implementation ``impl=None`` picks: the Hopper kernel on sm_90 for power-of-two head
    dims of 64 and more (its TMA tiles span D), at least ``HOPPER_MIN_PAIRS`` query-key pairs
    (B·H·N_q·N_k) and inputs that suit TMA (``tma_compatible``); else the portable one. At 2^27
    pairs both took 66 µs on an H100, and the Hopper launch costs the host 13 µs more (it encodes
    four TMA descriptors): course_lib/data/perf_notes.md, "O in q's layout"."""
    B, H, N_q, D = q.shape
    N_k = k.shape[-2] if k is not None else N_q
    if (DEVICE == "cuda" and "hopper" in IMPLS and D >= 64 and D & (D - 1) == 0
            and B * H * N_q * N_k >= HOPPER_MIN_PAIRS):
        if all(tma_compatible(t) for t in (q, k, v) if t is not None):
            return "hopper"
    return "portable"
