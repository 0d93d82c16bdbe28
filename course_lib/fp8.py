"""FP8 attention's accuracy, emulated exactly on any machine: what e4m3 costs, and what scales
and a random rotation buy back.

Introduced in notebooks/09b_fp8.ipynb. Hopper's tensor cores multiply FP8 at twice
the bf16 rate. FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao 2024,
"FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision", section 3.3,
https://arxiv.org/abs/2407.08608) runs its forward in e4m3 with two accuracy tools:

* **block quantization**: one scale per block of rows (the tile a program loads) instead of one
  per tensor;
* **incoherent processing**: Q and K multiplied by the same random orthogonal matrix M (a
  Hadamard matrix with random signs) before quantization. QKᵀ is unchanged, (QM)(KM)ᵀ = QMMᵀKᵀ,
  and an outlier in one channel is spread over all of them.

This module rounds the inputs (and P, which a kernel casts before its PV product) exactly as
the hardware's conversion does (``torch.float8_e4m3fn``: round to nearest even), and does
everything else in float64, so each error it reports comes from the rounding alone. It is a
numerical model, not a kernel; ``kernels/flash_fp8.py`` is the kernel that rounds as it does.

    python -m course_lib.fp8    # prints the error table and writes course_lib/data/fp8_errors.json
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from course_lib.reference import causal_mask

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
P_SCALE = 256.0  # P (at most 1) times this before its cast: weights down to 2^-17 survive
DATA = Path(__file__).resolve().parent / "data" / "fp8_errors.json"


def fake_quantize(x: torch.Tensor, dtype: torch.dtype, block: int | None = None,
                  per_tensor: bool = False) -> torch.Tensor:
    """x (..., N, D) rounded to ``dtype`` and back, in float64.

    For e4m3 a scale maps the largest |x| of each group onto 448 first (x ≈ x₈ · scale): one
    group per ``block`` rows of every (batch, head), or, with ``per_tensor``, one for the whole
    tensor. fp16 and bf16 take no scale."""
    x = x.double()
    if dtype != E4M3:
        return x.to(dtype).double()
    if per_tensor:
        scale = x.abs().amax().clamp_min(1e-30) / E4M3_MAX
        return (x / scale).to(E4M3).double() * scale
    if block is None:
        raise ValueError("block: give the rows per scale, or per_tensor=True")
    *lead, N, D = x.shape
    n_blocks = -(-N // block)
    padded = torch.nn.functional.pad(x, (0, 0, 0, n_blocks * block - N))
    tiles = padded.reshape(*lead, n_blocks, block, D)
    scale = tiles.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-30) / E4M3_MAX
    rounded = (tiles / scale).to(E4M3).double() * scale
    return rounded.reshape(*lead, n_blocks * block, D)[..., :N, :]


def random_rotation(d: int, seed: int = 0) -> torch.Tensor:
    """A random orthogonal (d, d) float64 matrix M = D_s H / √d: a random ±1 diagonal D_s, then
    Sylvester's Hadamard matrix H, as FlashAttention-3 builds it (section 3.3). A row x becomes
    x M = ((x ∘ s) H) / √d: the signs come first, so they decide which entries add and which
    cancel in each output; signs applied after H would change no magnitude. d must be a power
    of two."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d must be a power of two for a Hadamard matrix, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen).double() * 2 - 1
    return signs[:, None] * h / math.sqrt(d)  # rows of H signed: x M = (x ∘ s) H / √d


def attention_lowp(q, k, v, dtype: torch.dtype = E4M3, causal: bool = False,
                   sm_scale: float | None = None, block_m: int = 64, block_n: int = 64,
                   per_tensor: bool = False, rotate: bool = False, seed: int = 0,
                   rounded: str = "qkvp") -> torch.Tensor:
    """Attention with the operands a low-precision kernel rounds, rounded; float64 otherwise.

    q (B, H, N_q, D); k, v (B, H, N_k, D). ``rounded`` names which of q, k, v and p are rounded
    to ``dtype`` (the rest stay exact), so each one's share of the error can be measured. Q takes
    one scale per ``block_m`` rows, K and V per ``block_n`` rows (or one per tensor); P, in
    [0, 1] after the row max is taken out, is cast as P · P_SCALE (e4m3) or as it is (fp16,
    bf16), while the row sums l come from P before its cast, as a kernel's do. With ``rotate``,
    q and k are first multiplied by ``random_rotation(D, seed)``. Causal is bottom-right
    aligned; rows that see no key give 0."""
    if not set(rounded) <= set("qkvp"):
        raise ValueError(f"rounded must name some of q, k, v, p; got {rounded!r}")
    q, k, v = q.double(), k.double(), v.double()
    D, N_q, N_k = q.shape[-1], q.shape[-2], k.shape[-2]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if rotate:
        rot = random_rotation(D, seed).to(q.device)
        q, k = q @ rot, k @ rot
    if "q" in rounded:
        q = fake_quantize(q, dtype, block_m, per_tensor)
    if "k" in rounded:
        k = fake_quantize(k, dtype, block_n, per_tensor)
    if "v" in rounded:
        v = fake_quantize(v, dtype, block_n, per_tensor)
    s = q @ k.transpose(-1, -2) * sm_scale  # (B, H, N_q, N_k)
    if causal:
        s = s.masked_fill(~causal_mask(N_q, N_k, s.device), float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).min)  # no key: any m
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    if "p" in rounded:
        scale = P_SCALE if dtype == E4M3 else 1.0
        p = (p * scale).to(dtype).double() / scale
    return torch.where(l > 0, (p @ v) / l.clamp_min(1e-300), 0.0)


def outlier_inputs(shape, gen: torch.Generator) -> torch.Tensor:
    """Unit normal entries, and one in a thousand with a normal of standard deviation 10 added:
    rare large entries, the kind of input that FP8's error grows with."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    big = torch.rand(shape, generator=gen, dtype=torch.float64) < 1e-3
    return x + big * 10 * torch.randn(shape, generator=gen, dtype=torch.float64)


def channel_outliers(shape, gen: torch.Generator, channels: int = 4,
                     factor: float = 4.0) -> torch.Tensor:
    """Unit normal entries with the first ``channels`` channels ``factor`` times larger, in
    every row: large entries that sit in the same channels of Q and of K."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x[..., :channels] *= factor
    return x


def rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref.double()) ** 2).mean().sqrt())


# The rows of the table: (name, dtype, keywords of attention_lowp)
SCHEMES = (
    ("bf16", torch.bfloat16, {}),
    ("fp16", torch.float16, {}),
    ("fp8, one scale per tensor", E4M3, {"per_tensor": True}),
    ("fp8, one scale per block", E4M3, {}),
    ("fp8, per block + rotation", E4M3, {"rotate": True}),
)
PARTS = (("q and k only", "qk"), ("v only", "v"), ("p only", "p"))
# The kinds of input, as the figures name them
KIND_LABELS = {"normal": "unit normal", "outliers": "rare outliers",
               "outlier channels": "outlier channels in Q, K"}


def error_table(B: int = 1, H: int = 4, N: int = 1024, D: int = 128, seed: int = 0) -> dict:
    """RMS error of O against float64 attention (causal), for every scheme of ``SCHEMES`` on
    three kinds of input: unit normal, ``outlier_inputs`` (Q, K and V) and ``channel_outliers``
    (Q and K; V unit normal); and, per block without rotation, each operand's share (only it
    rounded). Seeded: the same inputs on every machine."""
    gen = torch.Generator().manual_seed(seed)
    shape = (B, H, N, D)
    inputs = {"normal": [torch.randn(shape, generator=gen, dtype=torch.float64)
                         for _ in range(3)],
              "outliers": [outlier_inputs(shape, gen) for _ in range(3)],
              "outlier channels": [channel_outliers(shape, gen), channel_outliers(shape, gen),
                                   torch.randn(shape, generator=gen, dtype=torch.float64)]}
    table = {"shape": {"B": B, "H": H, "N": N, "D": D, "causal": True, "block": 64,
                       "p_scale": P_SCALE, "seed": seed},
             "schemes": {}, "parts": {}}
    for kind, (q, k, v) in inputs.items():
        ref = attention_lowp(q, k, v, causal=True, rounded="")
        for name, dtype, kw in SCHEMES:
            out = attention_lowp(q, k, v, dtype, causal=True, **kw)
            table["schemes"].setdefault(name, {})[kind] = rms_error(out, ref)
        for name, which in PARTS:
            out = attention_lowp(q, k, v, E4M3, causal=True, rounded=which)
            table["parts"].setdefault(name, {})[kind] = rms_error(out, ref)
    return table


def load_table() -> dict:
    """The stored table (``python -m course_lib.fp8`` writes it; a test recomputes it)."""
    return json.loads(DATA.read_text())


def main() -> None:
    table = error_table()
    DATA.write_text(json.dumps(table, indent=1) + "\n")
    kinds = list(table["schemes"]["bf16"])
    print(f"{'RMS error of O':28s}" + "".join(f"{kind:>18s}" for kind in kinds))
    for group in ("schemes", "parts"):
        for name, errs in table[group].items():
            print(f"{name:28s}" + "".join(f"{errs[kind]:18.2e}" for kind in kinds))
    print("written", DATA)


if __name__ == "__main__":
    main()


__all__ = ["E4M3", "E4M3_MAX", "KIND_LABELS", "P_SCALE", "PARTS", "SCHEMES", "attention_lowp",
           "channel_outliers", "error_table", "fake_quantize", "load_table", "outlier_inputs",
           "random_rotation", "rms_error"]
