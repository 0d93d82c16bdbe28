"""How many programs a decode launch has, against the SMs: one program per head, as a kernel
built for training launches it, and split-KV with the split count ``flash_decode`` chooses.

Introduced in notebooks/11_kv_cache_gqa.ipynb (section 5). The split counts are the kernel's
own: ``course_lib.kernels.decode.choose_num_splits`` (the largest power of two of splits that
keeps the grid at ``PROGRAMS_PER_SM`` programs per SM or under) for a long cache, so the picture
follows the rule when the rule changes. Reference: T. Dao, D. Haziza, F. Massa, G. Sizov,
"Flash-Decoding for long-context inference", 2023,
https://crfm.stanford.edu/2023/10/12/flashdecoding.html.
"""
from __future__ import annotations

from matplotlib.figure import Figure

#: The cache the split counts are chosen for: long enough that every split holds many tiles.
N_KEYS = 131072
H, H_KV, HEAD_DIM = 32, 8, 128
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def split_counts(sms: int, batches=BATCHES, n_keys: int = N_KEYS) -> list[int]:
    """``choose_num_splits`` for each batch at ``n_keys`` cached keys, ``H_KV`` K/V heads and
    the key tile of head dim ``HEAD_DIM``, on ``sms`` SMs."""
    from course_lib.kernels.decode import DECODE_CONFIGS, choose_num_splits

    block_n = DECODE_CONFIGS[HEAD_DIM]["BLOCK_N"]
    return [choose_num_splits(b, H_KV, n_keys, block_n, sm_count=sms) for b in batches]


def decode_parallelism_figure(sms: int | None = None) -> Figure:
    """Programs launched at N_q = 1 by a one-program-per-head kernel (the course's
    ``flash_attn_v2``, with and without the GQA group's rows packed) and by split-KV
    (``flash_decode``), against the H100's SMs."""
    from course_lib.hardware import get_gpu
    from course_lib.iomodel.decode import fa_forward_programs, split_kv_programs
    from course_lib.kernels.decode import PROGRAMS_PER_SM

    sms = get_gpu("H100-SXM").sms if sms is None else sms
    splits = split_counts(sms)
    fig = Figure(figsize=(6.8, 4.4), layout="constrained")
    ax = fig.subplots()
    batches = list(BATCHES)
    ax.plot(batches, [fa_forward_programs(b, H, 1) for b in batches], marker="o",
            color="tab:blue", label=f"one program per head (flash_attn_v2): B·H, H = {H}")
    ax.plot(batches, [fa_forward_programs(b, H_KV, 1) for b in batches], marker="s",
            color="tab:cyan", label=f"… with GQA rows packed: B·H_kv, H_kv = {H_KV}")
    per_sm = "program" if PROGRAMS_PER_SM == 1 else "programs"
    ax.plot(batches, [split_kv_programs(b, H_KV, s) for b, s in zip(batches, splits)],
            marker="D", color="tab:red",
            label=f"split-KV (flash_decode): B·H_kv·splits, ≤ {PROGRAMS_PER_SM} {per_sm} per SM")
    ax.axhline(sms, color="k", ls="--", lw=1, label=f"{sms} SMs (H100)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set(xlabel="batch size B (decoding, N_q = 1)", ylabel="programs launched",
           title=f"Who keeps {sms} SMs busy at small batch?")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=10)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"11_decode_parallelism": decode_parallelism_figure}
