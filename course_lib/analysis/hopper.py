"""The numbers behind the Hopper kernel: shared memory per stage, the softmax/MMA ceiling, TMA.

Introduced in notebooks/09_hopper.ipynb, next to ``course_lib.kernels.flash_v2_hopper``:

* ``smem_bytes`` / ``config_rows``: the shared memory a config's tiles need (the Q tile plus
  ``num_stages`` K and V tiles) against an SM's 228 KiB (``course_lib.hardware``), and which
  candidates the kernel's table (``flash_v2_hopper.hopper_config``) runs for each head dim;
  ``plot_smem_per_stage`` draws it;
* ``score_costs``: the two numbers of the ceiling argument, per score element: the tensor-core
  time of its 4·D FLOPs and the exp2 + FP32 time of its softmax, from the CUDA Programming
  Guide's results per SM per clock, all at one clock (``sm_clock_ghz``: the clock of the
  datasheet's tensor rate in ``course_lib.hardware.GPUS``)
  (``pinned=True``: the shorter softmax of the pinned max, no row max and no rescaling);
* ``tma_tile_demo``: one descriptor load and one descriptor store that run past the end of a
  tensor, to show the copy engine clipping (no masks);
* ``load_probe``: the first H100 measurement, the table committed in
  ``course_lib/data/perf_notes.md``, as a result dict that ``bench.plots.plot_attention`` and
  ``analysis.flash_v2.speed_rows`` read like a stored benchmark;
* ``launch_config``: run one kernel with one fixed config (on a GPU it returns the compiled
  kernel: shared memory, registers, SASS).

References: Shah et al. 2024, FlashAttention-3 (§3.1 warp specialisation and ping-pong
scheduling, §3.2 intra-warpgroup overlap of softmax and GEMMs); NVIDIA, CUDA C++ Programming
Guide, "Arithmetic Instructions" (throughput per SM per clock).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import triton
import triton.language as tl

from course_lib._device import DEVICE
from course_lib.analysis.flash_v2 import PERF_NOTES
from course_lib.bench.kernel_configs import (  # noqa: F401 (the lesson reads them here)
    config_label,
    count_instructions,
    launch_config,
    smem_bytes,
)
from course_lib.hardware import GPUSpec, get_gpu

# ---------------------------------------------------------------------------------------------
# shared memory per pipeline stage
# ---------------------------------------------------------------------------------------------


def max_stages(BLOCK_M: int, BLOCK_N: int, D: int, budget_bytes: int, elem_bytes: int = 2) -> int:
    """The deepest pipeline whose tiles fit in ``budget_bytes`` (0 if not even the Q tile fits)."""
    left = budget_bytes - BLOCK_M * D * elem_bytes
    return max(0, left // (2 * BLOCK_N * D * elem_bytes))


def config_rows(configs=None, head_dims=(64, 128, 256),
                gpu: str | GPUSpec = "H100-SXM") -> list[dict]:
    """Per (head dim, candidate config, ``bench.kernel_configs.HOPPER_CONFIGS`` unless
    ``configs`` is given): the estimate, whether it fits one block's shared memory, and whether
    the kernel's table (``flash_v2_hopper.hopper_config``) runs it for some call: causal or
    not, short or long (``N_BUCKET``)."""
    from course_lib.bench.kernel_configs import HOPPER_CONFIGS, kept
    from course_lib.kernels import flash_v2_hopper as hop

    configs = HOPPER_CONFIGS if configs is None else configs
    spec = get_gpu(gpu)
    budget = spec.smem_per_block_bytes or spec.smem_per_sm_bytes
    rows = []
    for d in head_dims:
        for c in configs:
            est = smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], d, c.num_stages,
                             q_in_regs=c.kwargs.get("Q_IN_REGS", False))
            rows.append({"D": d, "config": config_label(c), "BLOCK_M": c.kwargs["BLOCK_M"],
                         "BLOCK_N": c.kwargs["BLOCK_N"], "warps": c.num_warps,
                         "stages": c.num_stages, "q_kib": est["q"] / 1024,
                         "per_stage_kib": est["per_stage"] / 1024,
                         "total_kib": est["total"] / 1024, "budget_kib": budget / 1024,
                         "fits": est["total"] <= budget,
                         "kept": any(kept(c, d, causal, n) for causal in (False, True)
                                     for n in (hop.SHORT_CAUSAL_N, 1 << 30))})
    return rows


def plot_smem_per_stage(head_dims=(64, 128, 256), gpu: str = "H100-SXM"):
    """Stacked bars: the Q tile and each stage's K + V tiles of every Hopper config, per head
    dim, against the shared memory one block may use; configs the kernel does not run are
    hatched."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = config_rows(head_dims=head_dims, gpu=gpu)
    fig = Figure(figsize=(4.6 * len(head_dims), 5.2), layout="constrained")
    axes = fig.subplots(1, len(head_dims), sharey=True, squeeze=False)[0]
    top = max(r["total_kib"] for r in rows)
    for ax, d in zip(axes, head_dims):
        sub = [r for r in rows if r["D"] == d]
        for x, r in enumerate(sub):
            hatch = None if r["kept"] else "//"
            ax.bar(x, r["q_kib"], color="tab:purple", hatch=hatch, edgecolor="white")
            for s in range(r["stages"]):
                ax.bar(x, r["per_stage_kib"], bottom=r["q_kib"] + s * r["per_stage_kib"],
                       color=("tab:blue", "tab:cyan")[s % 2], hatch=hatch, edgecolor="white")
            ax.text(x, r["total_kib"] + 4, f"{r['total_kib']:.0f}", ha="center", fontsize=10)
        ax.axhline(sub[0]["budget_kib"], color="crimson", ls="--", lw=1)
        ax.set_xticks(range(len(sub)), [r["config"] for r in sub], rotation=40, ha="right",
                      fontsize=10)
        ax.set_title(f"HEAD_DIM = {d}")
        ax.set_ylim(0, max(top, sub[0]["budget_kib"]) * 1.12)
    axes[0].set_ylabel("shared memory per program (KiB), fp16")
    budget = rows[0]["budget_kib"]
    axes[0].legend(handles=[Line2D([], [], color="crimson", ls="--", lw=1,
                                   label=f"{budget:.0f} KiB: one block's limit"),
                            Patch(color="tab:purple",
                                  label="Q tile (where Q stays in shared memory)"),
                            Patch(color="tab:blue", label="one stage: K + V tiles"),
                            Patch(facecolor="white", edgecolor="gray", hatch="//",
                                  label="not in the kernel's table")],
                   fontsize=10, loc="upper left")
    fig.suptitle(f"Hopper configs: tiles in flight against {get_gpu(gpu).name}'s shared memory",
                 fontsize=12)
    return fig


# ---------------------------------------------------------------------------------------------
# the ceiling: tensor-core time against softmax time, per score element
# ---------------------------------------------------------------------------------------------

MUFU_PER_SM_CYCLE = 16
"""exp2 (MUFU.EX2) results per SM per clock on sm_80/sm_90: CUDA C++ Programming Guide,
"Arithmetic Instructions", row "32-bit floating-point reciprocal, ..., base-2 exponential"."""
FP32_PER_SM_CYCLE = 128
"""32-bit add/multiply/fused multiply-add results per SM per clock on sm_90 (same table)."""
MMA_FLOPS_PER_SM_CYCLE = 4096
"""Dense fp16/bf16 tensor-core FLOPs per SM per clock on Hopper: twice an A100 SM's 2048, clock
for clock (NVIDIA, H100 Tensor Core GPU Architecture whitepaper). The datasheet's 989.4 TFLOP/s
over 132 SMs × 4096 is the clock of that rate (``sm_clock_ghz``)."""


def sm_clock_ghz(gpu: str | GPUSpec = "H100-SXM") -> float:
    """The one SM clock of the two-numbers model (``score_costs``): the clock at which the
    datasheet's dense fp16 tensor rate is quoted, that rate over SMs × ``MMA_FLOPS_PER_SM_CYCLE``
    (1.83 GHz on an H100 SXM). Hopper's per-clock MMA rate: sm_90 GPUs only."""
    spec = get_gpu(gpu)
    return spec.fp16_tensor_tflops * 1e12 / (spec.sms * MMA_FLOPS_PER_SM_CYCLE) / 1e9


def block_mma_cycles(BLOCK_M: int, BLOCK_N: int, D: int) -> float:
    """SM clock cycles of tensor-core work in one key block: QK^T and P V, 2·BLOCK_M·BLOCK_N·D
    FLOPs each, at ``MMA_FLOPS_PER_SM_CYCLE``."""
    return 2 * (2 * BLOCK_M * BLOCK_N * D) / MMA_FLOPS_PER_SM_CYCLE


def softmax_fp32_ops(D: int, BLOCK_N: int, pinned: bool = False) -> dict[str, float]:
    """FP32 instructions per score element in the unmasked loop of ``_online_softmax_step``,
    besides its exp2. The α-rescale of acc costs D multiplications per row and key block:
    D / BLOCK_N per score. With ``pinned`` (the pinned max of ``flash_v2_hopper``, after the
    first key block) there is no row max and no rescaling."""
    ops = {"scale and subtract the row max (one FFMA)": 1.0,
           "row max (FMNMX)": 1.0,
           "row sum of p (FADD)": 1.0,
           "convert p to fp16 (one F2FP per two scores)": 0.5,
           "rescale acc by α (FMUL, D / BLOCK_N)": D / BLOCK_N}
    if pinned:
        del ops["row max (FMNMX)"], ops["rescale acc by α (FMUL, D / BLOCK_N)"]
    return ops


def score_costs(D: int, gpu: str | GPUSpec = "H100-SXM", BLOCK_N: int = 128,
                pinned: bool = False) -> dict:
    """The two numbers, per score element, in picoseconds of the whole chip, all at one clock.

    Every unit's rate is its results per SM per clock times the SMs times ``sm_clock_ghz``:

    * MMA: 4·D FLOPs (QKᵀ and PV, the course's FLOP count) at ``MMA_FLOPS_PER_SM_CYCLE``
      (at that clock: the datasheet's dense fp16 tensor rate);
    * softmax: one exp2 at ``MUFU_PER_SM_CYCLE`` plus ``softmax_fp32_ops`` at
      ``FP32_PER_SM_CYCLE``. (The datasheet's FP32 TFLOP/s is quoted at a higher clock than
      its tensor rate; mixing the two would time the two halves with different clocks.)

    ``serial_tflops``: the throughput if the two never overlap (time = MMA + softmax), the
    design of the course's kernels; ``overlapped_tflops``: if they overlap perfectly (time =
    the larger one), what FlashAttention-3's ping-pong schedule aims at. A model, not a bound.
    ``pinned``: the softmax of the pinned max (``softmax_fp32_ops(..., pinned=True)``).
    """
    spec = get_gpu(gpu)
    sm_clocks_per_s = spec.sms * sm_clock_ghz(spec) * 1e9  # SM clock cycles of the whole chip
    flops = 4 * D
    ops = softmax_fp32_ops(D, BLOCK_N, pinned)
    t_mma = flops / (MMA_FLOPS_PER_SM_CYCLE * sm_clocks_per_s) * 1e12
    t_exp2 = 1 / (MUFU_PER_SM_CYCLE * sm_clocks_per_s) * 1e12
    t_fp32 = sum(ops.values()) / (FP32_PER_SM_CYCLE * sm_clocks_per_s) * 1e12
    t_soft = t_exp2 + t_fp32
    return {"D": D, "BLOCK_N": BLOCK_N, "gpu": spec.name, "mma_flops": flops,
            "fp32_ops": sum(ops.values()), "mma_ps": t_mma, "exp2_ps": t_exp2,
            "fp32_ps": t_fp32, "softmax_ps": t_soft, "softmax/mma": t_soft / t_mma,
            "bound": "softmax" if t_soft > t_mma else "MMA",
            "peak_tflops": spec.fp16_tensor_tflops,
            "serial_tflops": flops / (t_mma + t_soft),
            "overlapped_tflops": min(spec.fp16_tensor_tflops, flops / t_soft)}


def plot_ceiling(head_dims=(64, 128, 256), gpu: str = "H100-SXM", measured: dict | None = None,
                 pinned: bool = False):
    """Per head dim: MMA and softmax time per score (left), the two ceilings in TFLOP/s and,
    if given, ``measured`` {D: {label: TFLOP/s}} (right); with ``pinned`` also the no-overlap
    line of the pinned max's shorter softmax."""
    from matplotlib.figure import Figure

    costs = [score_costs(d, gpu) for d in head_dims]
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    x = range(len(head_dims))
    ax1.bar([i - 0.2 for i in x], [c["mma_ps"] for c in costs], 0.4, color="tab:green",
            label="MMA: 4·D FLOPs on tensor cores")
    ax1.bar([i + 0.2 for i in x], [c["exp2_ps"] for c in costs], 0.4, color="tab:red",
            label="exp2 (MUFU)")
    ax1.bar([i + 0.2 for i in x], [c["fp32_ps"] for c in costs], 0.4,
            bottom=[c["exp2_ps"] for c in costs], color="tab:orange",
            label="other FP32 softmax work")
    ax1.set_xticks(list(x), [f"D = {d}" for d in head_dims])
    ax1.set_ylabel("picoseconds per score element (whole chip)")
    ax1.set_title("The two numbers")
    ax1.legend(fontsize=10)
    ax2.plot(list(x), [c["serial_tflops"] for c in costs], "o-", color="tab:gray",
             label="no overlap (MMA + softmax)")
    ax2.plot(list(x), [c["overlapped_tflops"] for c in costs], "s--", color="tab:purple",
             label="perfect overlap (max)")
    if pinned:
        ax2.plot(list(x), [score_costs(d, gpu, pinned=True)["serial_tflops"] for d in head_dims],
                 "^:", color="tab:gray", label="no overlap, pinned max")
    ax2.axhline(costs[0]["peak_tflops"], color="k", lw=0.8, ls=":", label="dense fp16 peak")
    for label_i, (d_label, marker) in enumerate((("v2-hopper", "D"), ("sdpa-CUDNN_ATTENTION",
                                                                        "^"))):
        pts = [(i, measured[d][d_label]) for i, d in enumerate(head_dims)
               if measured and d in measured and measured[d].get(d_label)]
        if pts:
            ax2.plot(*zip(*pts), marker, ms=8, ls="none", color=f"C{label_i + 3}",
                     label=f"measured {d_label}")
    ax2.set_xticks(list(x), [f"D = {d}" for d in head_dims])
    ax2.set_ylabel("TFLOP/s")
    ax2.set_ylim(0, costs[0]["peak_tflops"] * 1.08)
    ax2.set_title("Ceilings of the model")
    ax2.legend(fontsize=10)
    fig.suptitle(f"{costs[0]['gpu']}: softmax against MMA per score element (BLOCK_N = "
                 f"{costs[0]['BLOCK_N']})", fontsize=12)
    return fig


# ---------------------------------------------------------------------------------------------
# TMA: the copy engine clips at the tensor's bounds
# ---------------------------------------------------------------------------------------------

@triton.jit
def _tma_tile_probe_kernel(desc_in, desc_out, OUT, start, BLOCK: tl.constexpr,
                           D: tl.constexpr):
    tile = desc_in.load([0, 0, start, 0]).reshape(BLOCK, D)  # no mask: rows past N are zeros
    offs = tl.arange(0, BLOCK)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(OUT + offs, tile)  # what arrived, into a plain (BLOCK, D) buffer
    desc_out.store([0, 0, start, 0], (tile + 1).reshape(1, 1, BLOCK, D))  # rows past N dropped


def tma_tile_demo(N: int = 20, D: int = 16, start: int = 16, BLOCK: int = 8) -> dict:
    """Load rows [start, start + BLOCK) of an (1, 1, N, D) tensor through a TMA descriptor and
    store them (plus one) back through another, with no mask although the tile runs past N.

    Returns ``x`` (the tensor, values 1, 2, ...), ``tile`` (what the load delivered) and
    ``buf``: a buffer of N + BLOCK rows, zeros, of which the store's descriptor sees only the
    first N; the rows past N stay zero because the store is clipped.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = (torch.arange(N * D, dtype=torch.float32) + 1).reshape(1, 1, N, D)
    x = x.to(device=DEVICE, dtype=torch.float16)
    buf = torch.zeros(1, 1, N + BLOCK, D, dtype=torch.float16, device=DEVICE)
    tile = torch.full((BLOCK, D), float("nan"), dtype=torch.float16, device=DEVICE)
    desc_in = TensorDescriptor.from_tensor(x, [1, 1, BLOCK, D])
    desc_out = TensorDescriptor.from_tensor(buf[:, :, :N], [1, 1, BLOCK, D])
    _tma_tile_probe_kernel[(1,)](desc_in, desc_out, tile, start, BLOCK=BLOCK, D=D)
    return {"x": x.cpu(), "tile": tile.cpu(), "buf": buf.cpu(), "N": N, "start": start,
            "BLOCK": BLOCK}


# ---------------------------------------------------------------------------------------------
# the first H100 measurement ("probe 1"), committed in course_lib/data/perf_notes.md
# ---------------------------------------------------------------------------------------------

_PROBE_COLUMNS = {"portable": "v2-portable", "hopper (TMA)": "v2-hopper",
                  "SDPA FLASH": "sdpa-FLASH_ATTENTION", "SDPA cuDNN": "sdpa-CUDNN_ATTENTION"}


def parse_probe_table(text: str, heading: str = "Forward, probe 1") -> dict:
    """The markdown table under the heading that contains ``heading``, as a result dict shaped
    like ``python -m course_lib.bench attention``'s (providers, rows with results → tflops)."""
    from course_lib.analysis.flash_v2 import markdown_table

    table = markdown_table(text, heading)
    head = list(table[0])
    providers = [_PROBE_COLUMNS[h] for h in head if h in _PROBE_COLUMNS]
    rows = []
    for rec in table:
        results = {_PROBE_COLUMNS[h]: {"tflops": float(rec[h]), "ms": None, "error": None}
                   for h in head if h in _PROBE_COLUMNS}
        rows.append({"D": int(rec["D"]), "causal": rec["causal"] not in ("0", "False"),
                     "N": int(rec["N"]), "results": results})
    env = {}
    m = re.search(r"\(([^,()]*H100[^,()]*), torch ([^,]+), triton ([^)]+)\)", text)
    if m:
        env = {"gpu": m.group(1).strip(), "torch": m.group(2).strip(),
               "triton": m.group(3).strip()}
    return {"subject": "attention", "mode": "fwd", "dtype": "fp16",
            "flops_formula": "4·B·H·N_q·N_k·D, ×½ causal", "providers": providers,
            "rows": rows, "environment": env, "source": f"perf_notes.md: {heading}"}


def load_probe(path: Path = PERF_NOTES) -> dict:
    """Probe 1 from the committed perf notes (see ``parse_probe_table``)."""
    return parse_probe_table(Path(path).read_text(encoding="utf-8"))


def impl_gain_rows(result: dict) -> list[dict]:
    """Per shape: portable and Hopper TFLOP/s, Hopper's gain, and both against SDPA's kernels."""
    out = []
    for r in result["rows"]:
        res = r["results"]

        def t(name):
            return res.get(name, {}).get("tflops")

        p, h = t("v2-portable"), t("v2-hopper")
        fa2, cudnn = t("sdpa-FLASH_ATTENTION"), t("sdpa-CUDNN_ATTENTION")
        out.append({"D": r["D"], "causal": r["causal"], "N": r["N"], "portable": p,
                    "hopper": h, "hopper/portable": h / p if p and h else None,
                    "hopper/FA2": h / fa2 if h and fa2 else None,
                    "hopper/cuDNN": h / cudnn if h and cudnn else None})
    return out


def _probe_figure():
    from course_lib.bench.plots import plot_attention

    return plot_attention(load_probe())


# ---------------------------------------------------------------------------------------------
# one kernel, one fixed config
# ---------------------------------------------------------------------------------------------

def autotune_bucket(N_q: int, N_k: int) -> int:
    """The length bucket in the autotune key: next power of two of max(N_q, N_k)."""
    return triton.next_power_of_2(max(N_q, N_k))


FIGURES = {"09_hopper_smem_per_stage": plot_smem_per_stage,
           "09_softmax_mma_ceiling": plot_ceiling,
           "09_probe1_tflops": _probe_figure,
           "09_two_programs_timeline": lambda: plot_block_timeline()}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""

__all__ = ["FP32_PER_SM_CYCLE", "MMA_FLOPS_PER_SM_CYCLE", "MUFU_PER_SM_CYCLE", "PERF_NOTES",
           "autotune_bucket", "block_mma_cycles",
           "config_label", "config_rows", "count_instructions", "impl_gain_rows",
           "launch_config", "load_probe", "max_stages", "parse_probe_table", "plot_ceiling",
           "plot_smem_per_stage", "score_costs", "sm_clock_ghz", "smem_bytes",
           "softmax_fp32_ops",
           "tma_tile_demo", "FIGURES"]


# ---------------------------------------------------------------------------------------------
# three ideas measured that did not pay (course_lib/data/hopper_ideas.json)
# ---------------------------------------------------------------------------------------------

HOPPER_IDEAS = Path(__file__).resolve().parent.parent / "data" / "hopper_ideas.json"
EXP2_POLY_COEFFS = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799,
                    0.05517164617776871)  # 2^f on [-1/2, 1/2], relative error 7.5e-5


@triton.jit
def exp2_poly(x):
    """2^x without the MUFU unit (FlashAttention-4's software exp2), for x <= 0.

    Split x = n + f with n = round(x) (adding 1.5·2^23 rounds an fp32 to an integer, which then
    sits in the low mantissa bits), approximate 2^f on [-1/2, 1/2] by a degree-3 polynomial
    (three FMAs), and add n to the result's exponent field with an integer add. Nine FP32/INT
    instructions instead of one MUFU.EX2. x is clamped at -126 (the smallest normal exponent).
    """
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0  # 1.5 * 2^23
    f = x - (t - 12582912.0)
    p = 0.05517164617776871 * f + 0.2426111251115799
    p = p * f + 0.6932609677314758
    p = p * f + 0.9999280571937561
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_poly_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    tl.store(Y + offs, exp2_poly(x), mask=offs < N)


def exp2_poly_demo(x: torch.Tensor) -> torch.Tensor:
    """``exp2_poly`` applied to an fp32 tensor by a small Triton kernel (interpreter or GPU)."""
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    x = x.contiguous().to(DEVICE)
    y = torch.empty_like(x)
    n = x.numel()
    _exp2_poly_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
    return y


def _load_json(path: Path) -> dict:
    import json

    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_ideas(path: Path = HOPPER_IDEAS) -> dict:
    """The stored measurements of the ideas (see ``ideas_rows``)."""
    return _load_json(path)


IDEAS = {
    "software exp2 on 1/4 of the scores": dict(poly_exp2="quarter"),
    "software exp2 on 1/2 of the scores": dict(poly_exp2="half (column halves)"),
    "lazy rescaling (only when the max grows by 2^8)": dict(lazy_rescale=True),
    "warp specialisation (tl.range warp_specialize)": dict(warp_specialize=True),
    "at most 168 registers (3 programs per SM)": dict(maxnreg=168),
    "next block's QKᵀ issued before this softmax": dict(next_qk_early=True),
}
_PLAIN = dict(poly_exp2="none", lazy_rescale=False, warp_specialize=False, maxnreg=0,
              next_qk_early=False)


def ideas_rows(data: dict | None = None, D: int = 64, N: int = 4096) -> list[dict]:
    """Per idea and causal flag: the best TFLOP/s with the idea against the best without it.

    Both bests come from the same run (GPU clocks and SDPA vary a few % between runs) and are
    taken over every config tried, so an idea that only rescues a poor config does not count.
    """
    data = load_ideas() if data is None else data
    rows = []
    fwd = [r for r in data["forward"] if r["D"] == D and r["N"] == N
           and r["provider"].startswith("v2-")]

    def label(r):
        return (f"{r['provider'][3:]} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['warps']} "
                f"s{r['stages']}")

    for idea, change in IDEAS.items():
        for causal in (False, True):
            tried = [r for r in fwd if r["causal"] == causal
                     and all(r.get(k, _PLAIN[k]) == v for k, v in change.items())
                     and all(r.get(k, v) == v for k, v in _PLAIN.items() if k not in change)]
            ok = [r for r in tried if "tflops" in r]
            failed = len(tried) - len(ok)
            row = {"idea": idea, "causal": causal, "tried": len(tried), "failed": failed}
            if not ok:
                rows.append({**row, "best without": None, "best with": None, "ratio": None})
                continue
            best = max(ok, key=lambda r: r["tflops"])
            plain = [r for r in fwd if r["causal"] == causal and r["run"] == best["run"]
                     and "tflops" in r and all(r.get(k, v) == v for k, v in _PLAIN.items())]
            base = max(plain, key=lambda r: r["tflops"])
            rows.append({**row, "best without": f"{base['tflops']:.0f} ({label(base)})",
                         "best with": f"{best['tflops']:.0f} ({label(best)})",
                         "ratio": best["tflops"] / base["tflops"]})
    return rows


# -------------------------------------------------------- paired measurements: tile shapes and more
HOPPER_TILES = HOPPER_IDEAS.with_name("hopper_tiles.json")

# Each idea against its baseline in the same paired rounds (hopper_tiles.json).
TILE_IDEAS = [
    # (idea, run, D, variant with the idea, the same without it)
    ("64 x 64 tiles at D 128 (two programs per SM)", "exp8", 128, "64x64w4s3", "128x128w8s3"),
    ("D 64: 64 x 64 tiles instead of 128 x 64", "exp8", 64, "64x64w4s3", "128x64w4s3"),
    ("causal heavy-first over 8 heads, 128 x 128 (D 128)", "exp9", 128, "128x128w8s3 o8",
     "128x128w8s3 o0"),
    ("causal heavy-first over 8 heads, 128 x 64 (D 64)", "exp9", 64, "128x64w4s3 o8",
     "128x64w4s3 o0"),
    ("causal heavy-first over 8 heads, 64 x 64 (D 128)", "exp9", 128, "64x64w4s3 o8",
     "64x64w4s3 o0"),
    ("causal masked blocks first (D 64)", "exp9", 64, "128x64w4s3 o8 mfirst", "128x64w4s3 o8"),
    ("packed fp16 exp2, ex2.approx.f16x2 (D 64)", "exp7", 64, "128x64w4s3 e16", "128x64w4s3"),
    ("packed fp16 exp2, ex2.approx.f16x2 (D 128)", "exp7", 128, "128x128w8s3 e16",
     "128x128w8s3"),
    ("persistent kernel, 2 programs per SM (D 64)", "exp7", 64, "P128x64w4s3 c2",
     "128x64w4s3"),
]


def load_tiles(path: Path = HOPPER_TILES) -> dict:
    """The stored paired measurements of tile shapes and launch orders (``tile_idea_rows``)."""
    return _load_json(path)


def _paired_gains(records: list[dict], D: int, with_: str, without: str):
    """(record, its variants) for each record at head dim ``D`` that timed both variants."""
    for r in records:
        v = r["variants"]
        if r["D"] == D and with_ in v and without in v:
            yield r, v


def tile_idea_rows(data: dict | None = None) -> list[dict]:
    """Per idea and shape: the idea's speed over its baseline's, both as paired ratios to SDPA
    FLASH_ATTENTION in the same rounds (so the GPU's clock drift cancels)."""
    data = load_tiles() if data is None else data
    rows = []
    for idea, run, D, with_, without in TILE_IDEAS:
        for r, v in _paired_gains(data["runs"][run], D, with_, without):
            rows.append({"idea": idea, "causal": r["causal"], "N": r["N"],
                         "without / FA2": v[without]["ratio"], "with / FA2": v[with_]["ratio"],
                         "with / without": v[with_]["ratio"] / v[without]["ratio"]})
    return rows


# ---------------------------------------------------------------------------------------------
# row sums on the tensor cores, and the power cap
# ---------------------------------------------------------------------------------------------

HOPPER_ROWSUM = HOPPER_IDEAS.with_name("hopper_rowsum.json")
ROWSUM_IDEAS = [
    # (idea, D, variant with the idea, the same without it)
    ("l on MMA, 64 x 64 tiles (D 128)", 128, "R16:64x64w4s3", "P:64x64w4s3"),
    ("l on MMA, 128 x 128 tiles (D 128)", 128, "R16:128x128w8s3", "P:128x128w8s3"),
    ("l on MMA, 128 x 64 tiles (D 64)", 64, "R16:128x64w4s3", "P:128x64w4s3"),
    ("l on mma.sync (8 columns), 128 x 64 (D 64)", 64, "R8:128x64w4s3", "P:128x64w4s3"),
    ("3 programs per SM (maxnreg 168, 2 stages), D 128", 128, "B:64x64w4s2r168",
     "P:64x64w4s3"),
]


def rowsum_rows(data: dict | None = None) -> list[dict]:
    """Per idea, run and shape of ``hopper_rowsum.json``: with / without, as paired ratios."""
    data = _load_json(HOPPER_ROWSUM) if data is None else data
    rows = []
    for idea, D, with_, without in ROWSUM_IDEAS:
        for run, rec in data["runs"].items():
            for r, v in _paired_gains(rec["paired"], D, with_, without):
                rows.append({"idea": idea, "run": run, "causal": r["causal"], "N": r["N"],
                             "with / without": v[with_]["ratio"] / v[without]["ratio"]})
    return rows


def _readable_variant(name: str) -> str:
    """A stored run's variant name in the lesson's words: "P:64x64w4s3" -> "64x64 w4 s3",
    "R16:..." -> "... l-MMA" (row sums on wgmma), "R8:..." -> "... l-MMA 8 cols (mma.sync)"."""
    if ":" not in name:
        return {"FA2": "SDPA FLASH", "flash_attn_v2": "flash_attn_v2 (autotuned)"}.get(name, name)
    kind, cfg = name.split(":", 1)
    cfg = re.sub(r"^(\d+x\d+)w(\d+)s(\d+)", r"\1 w\2 s\3", cfg)
    return cfg + {"P": "", "R16": " l-MMA", "R8": " l-MMA 8 cols (mma.sync)"}.get(kind, f" {kind}")


def clock_rows(data: dict | None = None, readable: bool = False) -> list[dict]:
    """The 1-second timings of ``hopper_rowsum.json`` with the SM clock and board power
    nvidia-smi read meanwhile: every kernel runs at the 700 W cap, at its own clock.
    ``readable``: runs numbered ("run 1", ...) and variants named as in the lesson
    (``_readable_variant``); otherwise the stored names ("exp10", "P:64x64w4s3")."""
    data = _load_json(HOPPER_ROWSUM) if data is None else data
    rows = []
    for i, (run, rec) in enumerate(data["runs"].items()):
        for s in rec["sustained"]:
            if s["round"] != 0:
                continue
            kernel = _readable_variant(s["variant"]) if readable else s["variant"]
            rows.append({"run": f"run {i + 1}" if readable else run, "D": s["D"], "N": s["N"],
                         "causal": s["causal"], "kernel": kernel, "TFLOP/s": s["tflops"],
                         "SM MHz": s["sm_mhz"],
                         "W": s["power_w"], "TFLOP/s per GHz": s["tflops"] / s["sm_mhz"] * 1e3})
    return rows


# ----------------------------------------------------------------------------------- the pinned max
HOPPER_PINNED = HOPPER_IDEAS.with_name("hopper_pinned.json")

PINNED_IDEAS = [
    # (idea, run, D, variant with the idea, the same without it)
    ("pinned max, 128 x 64 (D 64)", "pinned", 64, "128x64w4s3 pinned", "128x64w4s3"),
    ("pinned max + l on MMA, 64 x 64 (D 128)", "pinned", 128, "64x64w4s3 l-MMA pinned",
     "64x64w4s3 l-MMA"),
    ("pinned max, 128 x 128 w8 (D 128)", "pinned", 128, "128x128w8s3 pinned", "128x128w8s3"),
    ("pinned max, 64 x 64 Q smem (D 256)", "pinned_d256", 256, "64x64w4s2 Qsmem pinned",
     "64x64w4s2 Qsmem"),
    ("64 x 128 tiles instead of 128 x 64 (D 64)", "tiles_64x128", 64, "64x128w4s3", "128x64w4s3"),
    ("64 x 128 tiles, 3 programs per SM (2 stages, D 64)", "tiles_64x128", 64, "64x128w4s2",
     "128x64w4s3"),
]


def load_pinned() -> dict:
    """The pinned max's stored measurements: paired runs, clock stamps, the loop with parts of
    the softmax taken out (``hopper_pinned.json``)."""
    return _load_json(HOPPER_PINNED)


def pinned_rows(data: dict | None = None, spike: bool = False) -> list[dict]:
    """Per idea and shape: with / without, as paired ratios to SDPA FLASH in the same rounds.
    ``spike=True``: the worst case, where every row's later keys pass the pinned max by far and
    every program runs a second time with the running max."""
    data = load_pinned() if data is None else data
    rows = []
    for idea, run, D, with_, without in PINNED_IDEAS:
        recs = [r for r in data["runs"][run]["paired"] if r.get("spike", False) == spike]
        for r, v in _paired_gains(recs, D, with_, without):
            rows.append({"idea": idea, "D": D, "causal": r["causal"], "N": r["N"],
                         "with / FA2": v[with_]["ratio"], "without / FA2": v[without]["ratio"],
                         "with / without": v[with_]["ratio"] / v[without]["ratio"],
                         "TFLOP/s with": v[with_]["tflops"]})
    return rows


def kept_label(D: int) -> str:
    """The name ``hopper_pinned.json`` gives the config the kernel keeps at head dim ``D``
    (``flash_v2_hopper.hopper_config``, long sequences), e.g. "128x64w4s3 pinned"."""
    from course_lib.kernels import flash_v2_hopper as hop

    c = hop.hopper_config(D, False, 1 << 30)
    bm, bn, warps, stages = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
    q_regs, rowsum, pinned = (c.kwargs[f] for f in ("Q_IN_REGS", "ROWSUM_MMA", "PINNED_MAX"))
    return (f"{bm}x{bn}w{warps}s{stages}" + (" l-MMA" if rowsum else "")
            + ("" if q_regs else " Qsmem") + (" pinned" if pinned else ""))


def kept_vs_best_rows(data: dict | None = None) -> list[dict]:
    """Per shape of the pinned max's paired runs: the kept config's ratio to SDPA FLASH against
    the best other config timed in the same rounds (the worst-case rows left out)."""
    data = load_pinned() if data is None else data
    rows = []
    for run in ("pinned", "pinned_d256"):
        for r in data["runs"][run]["paired"]:
            if r.get("spike", False):
                continue
            v, kept = r["variants"], kept_label(r["D"])
            others = {k: x["ratio"] for k, x in v.items()
                      if k not in ("CUDNN", "flash_attn_v2", kept)}
            best = max(others, key=others.get)
            rows.append({"D": r["D"], "causal": r["causal"], "N": r["N"], "kept": kept,
                         "kept / FA2": v[kept]["ratio"], "best other": best,
                         "best other / FA2": others[best],
                         "kept / best other": v[kept]["ratio"] / others[best]})
    return rows


def timeline_rows(data: dict | None = None) -> list[dict]:
    """Where a program's time goes, from the %clock64 stamps of the instrumented kernel
    (SM clocks, medians over all programs): per key block, the softmax (from the row max to P
    ready) and the wait from P ready to the next S (P @ V, the next QK^T and the max);
    ``both in softmax`` is how often the SM's other program is in its softmax while this one
    is, against ``if independent`` (the softmax's share of the time)."""
    data = load_pinned() if data is None else data
    rows = []
    for r in data["timeline"]:
        rows.append({"kernel": r["name"], "block clk": r["block_clk(S ready -> next S ready)"],
                     "max clk": r["max_clk(S ready -> max done)"],
                     "softmax clk": r["softmax_clk"],
                     "P ready -> next S clk": r["mma_clk(P ready -> next S ready)"],
                     "prologue clk": r["prologue_clk(t0->S0 ready)"],
                     "epilogue clk": r["epilogue_clk(last P->end)"],
                     "other in softmax during wait": r["other_softmax_within_wait_clk"],
                     "other waiting during wait": r["other_wait_within_wait_clk"],
                     "both in softmax": r["both_in_softmax_given_one"],
                     "if independent": r["if_independent"],
                     "TFLOP/s (stamped)": r["tflops_instrumented"],
                     "TFLOP/s (plain)": r["tflops_plain"]})
    return rows


MMA_ONLY_MODES = {0: "full online softmax", 1: "MMAs only (P = S)", 2: "MMAs + exp2",
                  3: "MMAs + exp2 + row sums"}


def mma_only_rows(data: dict | None = None) -> list[dict]:
    """The loop with parts of the softmax taken out (TFLOP/s counted as 4·N²·D per head):
    what the MMAs alone reach with these tiles, and what each part of the softmax costs."""
    data = load_pinned() if data is None else data
    rows = {}
    for r in data["mma_only"]:
        if "mode" not in r:
            continue
        row = rows.setdefault((r["D"], r["cfg"]), {"D": r["D"], "config": r["cfg"]})
        row[MMA_ONLY_MODES[r["mode"]]] = r["tflops"]
    matmul = {r["D"]: r["tflops"] for r in data["mma_only"] if "mode" not in r}
    for row in rows.values():
        row["torch matmul"] = matmul.get(row["D"])
    return list(rows.values())


def plot_block_timeline(data: dict | None = None):
    """Two programs sharing one SM, six key blocks each (D 64, 128 x 64 tiles, the running max):
    the row max, the softmax, and the wait for P @ V, the next QK^T and its arrival, from the
    %clock64 stamps of ``hopper_pinned.json``. None where the data is missing."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    data = load_pinned() if data is None else data
    ex = data.get("timeline_excerpt")
    if not ex:
        return None
    mma = block_mma_cycles(128, 64, 64)  # the kernel of the excerpt
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax = fig.subplots()
    colors = {"max": "tab:orange", "softmax": "tab:red", "wait": "0.85"}
    for row, blocks in enumerate(ex["programs"]):
        y = 1 - row
        for j, (ta, tb, tc) in enumerate(blocks):
            ax.barh(y, tb - ta, left=ta, height=0.5, color=colors["max"])
            ax.barh(y, tc - tb, left=tb, height=0.5, color=colors["softmax"])
            if j + 1 < len(blocks):
                nxt = blocks[j + 1][0]
                ax.barh(y, nxt - tc, left=tc, height=0.5, color=colors["wait"])
                ax.plot([tc, tc + mma], [y - 0.32, y - 0.32], color="tab:green", lw=3)
    ax.set_yticks([1, 0], ["program A", "program B"])
    ax.set_xlabel("SM clock cycles")
    ax.legend(handles=[Patch(color=colors["max"], label="row max"),
                       Patch(color=colors["softmax"], label="exp2, row sums (P ready)"),
                       Patch(color=colors["wait"], label="P @ V, next QK^T, waiting"),
                       Patch(color="tab:green", label=f"the block's MMA work ({mma:.0f} cycles)")],
              fontsize=10, ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    ax.set_title(f"Two programs on one SM, {ex['kernel']}: %clock64 stamps per key block",
                 fontsize=11)
    return fig
