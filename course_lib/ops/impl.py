"""Which forward kernel runs a call: the portable one, or the Hopper (TMA) one.

Introduced in notebooks/09_hopper.ipynb. ``course_lib.ops.flash_attn_v2`` asks ``best_impl``
for the dense kernels (``flash_v2``, ``flash_v2_hopper``), and so does a call with lesson 15's
variants (``flash_variants``, ``flash_variants_hopper``): one rule for both families.
"""
from __future__ import annotations

import torch

from course_lib._device import DEVICE
from course_lib.kernels.flash_v2_hopper import tma_compatible


def _available_impls() -> tuple[str, ...]:
    if DEVICE == "cpu":
        return ("portable", "hopper")  # the interpreter runs both kernels
    if torch.cuda.get_device_capability()[0] >= 9:
        return ("portable", "hopper")
    return ("portable",)


IMPLS = _available_impls()


# The Hopper kernel from this much work on: B·H·N_q·N_k query-key pairs (see best_impl).
HOPPER_MIN_PAIRS = 1 << 28


def best_impl(q: torch.Tensor, k: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> str:
    """The implementation ``impl=None`` picks: the Hopper kernel on sm_90 for power-of-two head
    dims of 64 and more (its TMA tiles span exactly D) and at least ``HOPPER_MIN_PAIRS``
    query-key pairs (B·H·N_q·N_k), when every input suits TMA (``tma_compatible``); else the
    portable one. The measurements behind it: the Hopper kernel is faster on the GPU at every
    shape of the sweep from D 64 on (B·N = 32k: course_lib/data/attention_fwd.json), but even
    its bound launch has Triton's launcher encode four TMA descriptors, so a call costs the
    host about 13 µs more. At the capstone's shape (B 1, H 32, H_kv 8, D 64, bf16, causal) on
    an H100, 2026-11-27 (course_lib/data/perf_notes.md, "O in q's layout ..."): N 2048 (2^27
    pairs), GPU 65.9 µs portable and 66.0 µs Hopper, host 19.8 and 33.0 µs; N 4096 (2^29), GPU
    201.4 and 177.1 µs."""
    D = q.shape[-1]
    B, H, N_q = q.shape[0], q.shape[1], q.shape[2]
    N_k = k.shape[-2] if k is not None else N_q
    if (DEVICE == "cuda" and "hopper" in IMPLS and D >= 64 and D & (D - 1) == 0
            and B * H * N_q * N_k >= HOPPER_MIN_PAIRS):
        if all(tma_compatible(t) for t in (q, k, v) if t is not None):
            return "hopper"
    return "portable"

