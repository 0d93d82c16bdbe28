"""Reference attention in fp32/fp64: the ground truth every kernel of the course is tested against.

Introduced in notebooks/04_attention_io.ipynb; the derivation's steps (2-pass, 1-pass, the
FlashAttention v1 and v2 loop orders) are added in notebooks/05 and 06.

Conventions shared by every implementation in the course:

* ``q`` (B, H, N_q, D); ``k``, ``v`` (B, H_kv, N_k, D) with H a multiple of H_kv (GQA: query
  head ``h`` reads key/value head ``h // (H // H_kv)``).
* ``causal=True`` is *bottom-right* aligned: query ``i`` sees keys ``j <= i + N_k - N_q``
  (FlashAttention >= 2.1, ``torch.nn.attention.bias.causal_lower_right``). With N_q > N_k the
  first rows see no key at all: their output is 0 and their log-sum-exp is -inf.
* Dropout multiplies the *normalised* probabilities P by a keep-mask / (1 - p). The mask comes
  from ``dropout_mask(...)`` with a seed, so every implementation can use the same one.
* ``lse`` is the natural-log log-sum-exp of each row of the scaled scores ``S = sm_scale·QKᵀ``.
"""
from __future__ import annotations

import math

import torch


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def expand_kv(k: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat each K/V head for the query heads of its group: (B, H_kv, N, D) -> (B, H, N, D)."""
    h_kv = k.shape[1]
    if n_heads % h_kv:
        raise ValueError(f"q's {n_heads} heads are not a multiple of k/v's {h_kv} heads")
    return k.repeat_interleave(n_heads // h_kv, dim=1)


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """Boolean (N_q, N_k) mask, True where query i may see key j (bottom-right aligned)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def dropout_mask(shape, dropout_p: float, dropout_seed: int, device=None) -> torch.Tensor:
    """The reproducible keep-mask (True = keep) of shape (B, H, N_q, N_k) for a seed.

    Drawn on the CPU with its own generator so the same seed gives the same mask everywhere.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_seed is None:
        raise ValueError("dropout_seed is required when dropout_p > 0 (the mask must be reproducible)")
    gen = torch.Generator(device="cpu").manual_seed(int(dropout_seed))
    keep = torch.rand(tuple(shape), generator=gen) >= dropout_p
    return keep.to(device) if device is not None else keep


def _check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D: (B, H, N, D)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q's {q.shape[1]} heads are not a multiple of k's {k.shape[1]} heads")


def attention(q, k, v, causal=False, sm_scale=None, dropout_p=0.0, dropout_seed=None,
              return_lse=False):
    """Standard attention O = dropout(softmax(sm_scale·QKᵀ + mask))·V in fp32 (fp64 for fp64 input).

    Returns O (B, H, N_q, D) in the compute dtype, and the log-sum-exp (B, H, N_q) if asked.
    """
    _check_qkv(q, k, v)
    dt = _compute_dtype(q)
    B, H, N_q, D = q.shape
    N_k = k.shape[2]
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    q, k, v = q.to(dt), expand_kv(k.to(dt), H), expand_kv(v.to(dt), H)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, N_q, N_k)
    if causal:
        s = s.masked_fill(~causal_mask(N_q, N_k, s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, N_q); -inf for rows that see no key
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])  # (B, H, N_q, N_k); rows with no key are all 0
    if dropout_p > 0.0:
        keep = dropout_mask((B, H, N_q, N_k), dropout_p, dropout_seed, p.device)
        p = p * keep / (1.0 - dropout_p)
    o = torch.matmul(p, v)  # (B, H, N_q, D)
    return (o, lse) if return_lse else o


def attention_flops(B, H, N_q, N_k, D, causal=False, mode="fwd") -> float:
    """FLOPs the course counts for attention: forward 4·B·H·N_q·N_k·D (×½ causal), backward 2.5×."""
    flops = 4.0 * B * H * N_q * N_k * D
    if causal:
        flops *= 0.5
    if mode == "bwd":
        flops *= 2.5
    elif mode == "fwd_bwd":
        flops *= 3.5
    elif mode != "fwd":
        raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd_bwd', got {mode!r}")
    return flops


LOG2E = 1.0 / math.log(2.0)
