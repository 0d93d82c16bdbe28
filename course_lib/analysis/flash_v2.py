"""What the FlashAttention-2 kernel decides before it computes, in plain Python.

Introduced in notebooks/08_triton_flash_v2.ipynb. ``course_lib.kernels.flash_v2`` launches a grid
of (⌈N_q/BLOCK_M⌉, B·H) programs; each program owns BLOCK_M query rows and asks
``_causal_bounds`` which key blocks it must visit, and which of those need a mask. This module
mirrors that bookkeeping line by line so a lesson can draw it, count it and test it:

* ``causal_bounds``: the Python twin of the kernel's ``_causal_bounds`` (``kernel_bounds`` runs
  the real ``@triton.jit`` function and returns the same numbers, a test checks both agree);
* ``causal_block_kinds``: every (Q block, K block) pair as skipped / unmasked / masked, and
  ``plot_block_kinds`` its picture;
* ``program_order`` / ``kv_reuse``: which (batch, head, Q block) each program of the grid takes,
  in the order the GPU hands programs out, and how far apart the readers of one K/V head are;
* ``normalisation_ops``: the multiplications and divisions that deferred normalisation saves
  (Dao 2023, FlashAttention-2, §3.1.1);
* ``speed_rows`` / ``hbm_rows``: the stored benchmark (``python -m course_lib.bench attention``
  and ``... hbm``) reduced to the rows the lessons print.

Causal masking is bottom-right aligned, as everywhere in the course: query i sees key j iff
j ≤ i + N_k − N_q (``course_lib.reference.causal_mask``).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE
from course_lib.kernels.attention_common import _causal_bounds

SKIPPED, UNMASKED, MASKED = 0, 1, 2
KINDS = ("skipped", "unmasked", "masked")
"""Names of the three kinds of key blocks, indexed by the codes above."""

KIND_COLORS = ("#e6e6e6", "#4c9be8", "#f5a142")

PERF_NOTES = Path(__file__).resolve().parents[1] / "data" / "perf_notes.md"
"""The lead's measurement log (predict, change, measure, look back), committed with the code."""


# ---------------------------------------------------------------------------------------------
# the key range of one Q block
# ---------------------------------------------------------------------------------------------

def causal_bounds(start_m: int, N_q: int, N_k: int, causal: bool, BLOCK_M: int,
                  BLOCK_N: int) -> tuple[int, int]:
    """(lo_masked, hi) for the Q block whose first row is ``start_m``: the kernel's arithmetic.

    Keys [0, lo_masked) are visited without any mask (every row of the block sees every one of
    them and they all exist); keys [lo_masked, hi) are visited with the mask, in BLOCK_N steps;
    blocks from hi on are skipped. ``hi`` can be ≤ 0 (no row of the block sees any key).
    """
    if causal:
        offset = N_k - N_q
        hi = min(N_k, start_m + BLOCK_M + offset)  # last key any row of the block sees, + 1
        full = max(start_m + offset + 1, 0)  # keys every row of the block sees
        lo_masked = min((full // BLOCK_N) * BLOCK_N, max(hi, 0))
    else:
        hi = N_k
        lo_masked = (N_k // BLOCK_N) * BLOCK_N
    return lo_masked, hi


def key_block_kinds(start_m: int, N_q: int, N_k: int, BLOCK_M: int, BLOCK_N: int,
                    causal: bool = True) -> list[int]:
    """The kind (SKIPPED, UNMASKED or MASKED) of every key block for one Q block."""
    lo_masked, hi = causal_bounds(start_m, N_q, N_k, causal, BLOCK_M, BLOCK_N)
    kinds = []
    for start_n in range(0, N_k, BLOCK_N):
        if start_n + BLOCK_N <= lo_masked:  # the kernel's first loop: range(0, lo_masked)
            kinds.append(UNMASKED)
        elif lo_masked <= start_n < hi:  # its second loop: range(lo_masked, hi, BLOCK_N)
            kinds.append(MASKED)
        else:
            kinds.append(SKIPPED)
    return kinds


def causal_block_kinds(N_q: int, N_k: int, BLOCK_M: int, BLOCK_N: int,
                       causal: bool = True) -> np.ndarray:
    """(T_r, T_c) array of kinds: row i is Q block i, column j is key block j."""
    return np.array([key_block_kinds(start_m, N_q, N_k, BLOCK_M, BLOCK_N, causal)
                     for start_m in range(0, N_q, BLOCK_M)], dtype=np.int64).reshape(
        math.ceil(N_q / BLOCK_M), math.ceil(N_k / BLOCK_N))


def kind_counts(kinds: np.ndarray) -> dict[str, int]:
    """How many blocks of each kind: {"skipped": ..., "unmasked": ..., "masked": ...}."""
    return {name: int((np.asarray(kinds) == code).sum()) for code, name in enumerate(KINDS)}


def computed_fraction(N_q: int, N_k: int, BLOCK_M: int, BLOCK_N: int,
                      causal: bool = True) -> dict[str, float]:
    """Fractions of the N_q × N_k score matrix: computed by the kernel, and visible.

    "computed" counts the scores of every visited block (clipped at N_q and N_k): the work the
    tensor cores really do. "visible" counts the scores the causal mask lets through: what the
    FLOP formula's ½ stands for.
    """
    kinds = causal_block_kinds(N_q, N_k, BLOCK_M, BLOCK_N, causal)
    rows = [min(BLOCK_M, N_q - i * BLOCK_M) for i in range(kinds.shape[0])]
    cols = [min(BLOCK_N, N_k - j * BLOCK_N) for j in range(kinds.shape[1])]
    area = np.outer(rows, cols)
    computed = float(area[kinds != SKIPPED].sum()) / (N_q * N_k)
    if causal:
        visible = sum(max(0, min(N_k, i + N_k - N_q + 1)) for i in range(N_q)) / (N_q * N_k)
    else:
        visible = 1.0
    return {"computed": computed, "visible": visible}


# ---------------------------------------------------------------------------------------------
# the same numbers from the kernel's own @triton.jit function
# ---------------------------------------------------------------------------------------------

@triton.jit
def _bounds_probe_kernel(OUT, N_Q, N_K, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    lo_masked, hi = _causal_bounds(pid * BLOCK_M, N_Q, N_K, CAUSAL, BLOCK_M, BLOCK_N)
    tl.store(OUT + 2 * pid, lo_masked)
    tl.store(OUT + 2 * pid + 1, hi)


def kernel_bounds(N_q: int, N_k: int, BLOCK_M: int, BLOCK_N: int,
                  causal: bool = True) -> list[tuple[int, int]]:
    """[(lo_masked, hi)] per Q block, computed by ``flash_v2._causal_bounds`` itself.

    One tiny program per Q block calls the jitted function and stores its two numbers (on the
    GPU, or in Triton's interpreter on a CPU).
    """
    T_r = math.ceil(N_q / BLOCK_M)
    out = torch.full((T_r, 2), -(2**30), dtype=torch.int32, device=DEVICE)
    _bounds_probe_kernel[(T_r,)](out, N_q, N_k, CAUSAL=bool(causal), BLOCK_M=BLOCK_M,
                                 BLOCK_N=BLOCK_N)
    return [tuple(int(x) for x in row) for row in out.cpu().tolist()]


# ---------------------------------------------------------------------------------------------
# pictures
# ---------------------------------------------------------------------------------------------

def plot_block_kinds(N_q: int = 1000, N_k: int = 1000, BLOCK_M: int = 128, BLOCK_N: int = 64,
                     causal: bool = True, ax=None):
    """The (Q block, K block) grid coloured by kind, with the exact causal boundary drawn on it."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    kinds = causal_block_kinds(N_q, N_k, BLOCK_M, BLOCK_N, causal)
    T_r, T_c = kinds.shape
    if ax is None:
        ax = Figure(figsize=(min(11.0, max(7.0, 3.5 + 0.3 * T_c)), max(3.2, 1.4 + 0.3 * T_r)),
                    layout="constrained").subplots()
    ax.imshow(kinds, cmap=ListedColormap(KIND_COLORS), vmin=0, vmax=2, aspect="equal",
              extent=(0, T_c, T_r, 0), interpolation="nearest")
    ax.set_xticks(np.arange(T_c + 1), minor=True)
    ax.set_yticks(np.arange(T_r + 1), minor=True)
    ax.grid(which="minor", color="white", lw=1)
    ax.tick_params(which="minor", length=0)
    if causal:  # last visible key of each query row, in block units
        rows = np.linspace(0, N_q, 400)
        cols = np.clip(rows + (N_k - N_q) + 1, 0, N_k)
        ax.plot(cols / BLOCK_N, rows / BLOCK_M, color="k", lw=1.2,
                label="last visible key of each row")
    if N_k % BLOCK_N:
        ax.axvline(N_k / BLOCK_N, color="crimson", ls="--", lw=1, label=f"N_k = {N_k}")
    if N_q % BLOCK_M:
        ax.axhline(N_q / BLOCK_M, color="purple", ls=":", lw=1, label=f"N_q = {N_q}")
    ax.set_xlabel(f"key block j (BLOCK_N = {BLOCK_N})")
    ax.set_ylabel(f"Q block i (BLOCK_M = {BLOCK_M})")
    c = kind_counts(kinds)
    ax.set_title(f"{'causal' if causal else 'non-causal'}, N_q = {N_q}, N_k = {N_k}:\n"
                 f"{c['skipped']} skipped, {c['unmasked']} unmasked, {c['masked']} masked",
                 fontsize=10)
    handles = [Patch(color=KIND_COLORS[i], label=KINDS[i]) for i in range(3)]
    handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax.figure


# ---------------------------------------------------------------------------------------------
# the grid: which program computes what, in which order
# ---------------------------------------------------------------------------------------------

ORDERS = ("q_blocks_fastest", "heads_fastest")
"""The kernel's grid order (Q blocks on axis 0, since the first HBM measurement) and the one
it had before (heads on axis 0), kept for the comparison in notebooks/08."""


def grid(B: int, H: int, N_q: int, BLOCK_M: int,
         order: str = "q_blocks_fastest") -> tuple[int, int]:
    """The launch grid of ``flash_attn_v2``: (⌈N_q / BLOCK_M⌉, B·H); axis 0 varies fastest."""
    n_m = math.ceil(N_q / BLOCK_M)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return (n_m, B * H) if order == "q_blocks_fastest" else (B * H, n_m)


def program_order(B: int, H: int, H_kv: int, N_q: int, BLOCK_M: int, causal: bool = False,
                  order: str = "q_blocks_fastest") -> list[tuple[int, int, int, int]]:
    """(b, h, h_kv, pid_m) of every program, in launch order (grid axis 0 varies fastest).

    Mirrors ``flash_v2._q_block_program`` (all Q-block kernels): b = pid_bh // H, h = pid_bh % H,
    h_kv = h // (H / H_kv), and with ``causal`` the Q block index is reversed (longest rows
    first). The GPU hands out programs in this order in practice (CUDA does not promise it).
    ``order="heads_fastest"`` gives the order of the kernel's first version.
    """
    if H % H_kv:
        raise ValueError(f"H = {H} is not a multiple of H_kv = {H_kv}")
    group = H // H_kv
    n_m = math.ceil(N_q / BLOCK_M)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "q_blocks_fastest":
        pairs = [(m, bh) for bh in range(B * H) for m in range(n_m)]
    else:
        pairs = [(m, bh) for m in range(n_m) for bh in range(B * H)]
    out = []
    for launch_m, pid_bh in pairs:
        pid_m = n_m - 1 - launch_m if causal else launch_m
        b, h = divmod(pid_bh, H)
        out.append((b, h, h // group, pid_m))
    return out


def kv_reuse(B: int, H: int, H_kv: int, N_q: int, N_k: int, D: int, BLOCK_M: int,
             order: str = "q_blocks_fastest", elem_bytes: int = 2) -> dict:
    """How far apart, in launch order, two programs that read the same K/V head are.

    For every two consecutive readers of one K/V head: the programs launched between them and
    the K/V bytes those programs read (2·N_k·D·elem_bytes per other K/V head they touch,
    non-causal). If that is more than the L2 cache holds, the second reader finds its K/V
    evicted and reads it from DRAM again. Returns the largest of each.
    """
    import numpy as np

    keys = np.array([b * H_kv + h_kv for b, _, h_kv, _ in
                     program_order(B, H, H_kv, N_q, BLOCK_M, order=order)])
    last: dict[int, int] = {}
    worst_programs, worst_heads = 0, 0
    for i, key in enumerate(keys.tolist()):
        j = last.get(key)
        if j is not None and i - j - 1 > 0:
            worst_programs = max(worst_programs, i - j - 1)
            worst_heads = max(worst_heads, len(np.unique(keys[j + 1:i])))
        last[key] = i
    return {"order": order, "programs_between": worst_programs,
            "kv_bytes_between": worst_heads * 2 * N_k * D * elem_bytes}


def programs_table(shape_list: list[dict], BLOCK_M: int = 128, sms: int = 132) -> list[dict]:
    """Programs launched by v1 (B·H) and v2 (B·H·⌈N/BLOCK_M⌉) per shape, against ``sms``."""
    rows = []
    for s in shape_list:
        v1 = s["B"] * s["H"]
        v2 = math.prod(grid(s["B"], s["H"], s["N"], BLOCK_M))  # same count in either order
        rows.append({**s, "v1 programs": v1, "v2 programs": v2, "v1 / SMs": v1 / sms,
                     "v2 / SMs": v2 / sms})
    return rows


# ---------------------------------------------------------------------------------------------
# deferred normalisation: what it saves
# ---------------------------------------------------------------------------------------------

def normalisation_ops(N_k: int, BLOCK_M: int, BLOCK_N: int, D: int) -> dict:
    """Non-matmul work on the (BLOCK_M, D) output tile of one Q block over all T_c key blocks.

    Normalised every step (v1's O_new = (l·α·O + β·P̃V) / l_new): per step 2·BLOCK_M·D
    multiplications and BLOCK_M·D divisions. Deferred (v2's acc = α·acc + P̃V, O = acc / l at
    the end): per step BLOCK_M·D multiplications (P̃V is accumulated by the MMA itself), and
    BLOCK_M·D divisions once.
    """
    T_c = math.ceil(N_k / BLOCK_N)
    tile = BLOCK_M * D
    every = {"multiplications": 2 * T_c * tile, "divisions": T_c * tile}
    deferred = {"multiplications": T_c * tile, "divisions": tile}
    saved = {k: every[k] - deferred[k] for k in every}
    return {"T_c": T_c, "every_step": every, "deferred": deferred, "saved": saved}


# ---------------------------------------------------------------------------------------------
# the stored benchmark, reduced to what the lessons print
# ---------------------------------------------------------------------------------------------

def speed_rows(result: dict, providers=None) -> list[dict]:
    """One row per shape of a stored ``attention_fwd`` result: TFLOP/s per provider, and each
    ``v2-*`` provider's ratio to SDPA FLASH_ATTENTION (the FlashAttention-2 CUDA kernel)."""
    from course_lib.bench.attention import REFERENCE, ratio

    names = providers or [p for p in result["providers"]
                          if p.startswith("v2-") or p in (REFERENCE, "sdpa-CUDNN_ATTENTION")]
    rows = []
    for r in result["rows"]:
        res = r["results"]
        row = {"D": r["D"], "causal": r["causal"], "N": r["N"]}
        for p in names:
            row[p] = res.get(p, {}).get("tflops")
        ref = res.get(REFERENCE, {}).get("tflops")
        for p in names:
            if p.startswith("v2-"):
                row[f"{p}/FA2"] = ratio(row[p], ref)
        rows.append(row)
    return rows


HBM_GOAL = 1.05
"""v2's measured DRAM bytes should be within this factor of the minimum (Q, K, V, O, lse once)."""


def hbm_rows(result: dict) -> list[dict]:
    """The stored ``hbm`` result's rows with the verdict against ``HBM_GOAL`` for v2 targets."""
    out = []
    for r in result["rows"]:
        row = {k: r.get(k) for k in ("target", "total_gb", "predicted_gb", "x minimum",
                                     "error")}
        if r["target"].startswith("v2-") and r.get("x minimum") is not None:
            row["meets goal"] = r["x minimum"] <= HBM_GOAL
        out.append(row)
    return out


def markdown_table(text: str, heading: str) -> list[dict]:
    """The first markdown table under the first heading line that contains ``heading``, as one
    dict per row (cell text, keyed by the header)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("#") and heading in ln), None)
    if start is None:
        raise ValueError(f"no heading containing {heading!r}")
    table = []
    for ln in lines[start + 1:]:
        if ln.startswith("#"):
            break
        if ln.strip().startswith("|"):
            table.append([c.strip() for c in ln.strip().strip("|").split("|")])
        elif table:
            break
    if len(table) < 3:
        raise ValueError(f"no table under {heading!r}")
    return [dict(zip(table[0], cells)) for cells in table[2:]]  # table[1] is the |---| line


def hbm_measurement_1(path: Path = PERF_NOTES) -> list[dict]:
    """The first Nsight Compute DRAM measurement (perf_notes.md), taken with the kernel's first
    grid order (heads fastest): [{"target", "gb", "x minimum"}]."""
    rows = markdown_table(Path(path).read_text(encoding="utf-8"), "HBM traffic, measurement 1")
    return [{"target": r["target"], "gb": float(r["measured GB"]),
             "x minimum": float(r["× minimum"])} for r in rows]


FIGURES = {"08_causal_block_kinds": plot_block_kinds}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
