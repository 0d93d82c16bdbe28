"""One Hopper-kernel config at a time: its label, its shared memory, a fixed-config launch.

Introduced in notebooks/09_hopper.ipynb. The benchmarks that time or compile configs one by one
(``python -m course_lib.bench hopper`` and ``hopper_compiled``) and the lesson's cells use these,
so that they launch exactly what the kernels' wrappers launch, with one ``triton.Config`` and no
autotuner. ``count_instructions`` reads a compiled kernel's SASS.
"""
from __future__ import annotations

import re

import triton

from course_lib._device import DEVICE
from course_lib.kernels import flash_v2 as v2
from course_lib.kernels import flash_v2_hopper as hop
from course_lib.kernels.attention_common import interpreter_errstate

# The Hopper kernel's candidate configs, as ``flash_v2_hopper._cfg(BLOCK_M, BLOCK_N, warps,
# stages, Q_IN_REGS, ROWSUM_MMA, PINNED_MAX)``: what the benchmarks time one by one, and from
# which the kernel's table (``flash_v2_hopper.hopper_config``) took one per head dim.
HOPPER_CONFIGS = [
    hop._cfg(128, 128, 8, 3), hop._cfg(128, 128, 8, 3, False), hop._cfg(128, 128, 8, 2),
    hop._cfg(128, 128, 8, 2, False), hop._cfg(128, 64, 4, 3), hop._cfg(128, 64, 4, 3, False),
    hop._cfg(128, 64, 4, 4), hop._cfg(64, 64, 4, 3), hop._cfg(64, 64, 4, 3, True, True),
    hop._cfg(64, 64, 4, 2, False), hop._cfg(128, 64, 4, 3, True, False, True),
    hop._cfg(64, 64, 4, 3, True, True, True), hop._cfg(128, 128, 8, 3, True, False, True),
    hop._cfg(64, 64, 4, 2, False, False, True), hop._cfg(64, 64, 4, 3, True, False, True),
]


def kept(cfg, head_dim: int, causal: bool = False, n_bucket: int = 1 << 30) -> bool:
    """Whether ``cfg`` is the config the Hopper kernel runs for this head dim, causal flag and
    length bucket (``flash_v2_hopper.hopper_config``)."""
    return config_label(cfg) == config_label(hop.hopper_config(head_dim, causal, n_bucket))


def smem_bytes(BLOCK_M: int, BLOCK_N: int, D: int, stages: int, elem_bytes: int = 2,
               q_in_regs: bool = False) -> dict:
    """Shared memory of one program's tiles: Q once, and per stage one K and one V tile.

    An estimate of what the software pipeline keeps in flight: the compiler may need a little
    more (barriers, layout conversions, the output tile of the TMA store) or reuse some. With
    ``q_in_regs`` the Q tile lives in registers for the loop and its buffer is reused (measured
    on an H100: 128x64 s3 at D 64 needs 48.1 KiB with Q in registers, 65.0 KiB without).
    """
    q = 0 if q_in_regs else BLOCK_M * D * elem_bytes
    per_stage = 2 * BLOCK_N * D * elem_bytes  # K tile + V tile
    return {"q": q, "per_stage": per_stage, "stages": stages, "total": q + stages * per_stage}


def config_label(cfg) -> str:
    """"128x64 w4 s3": tile shape, warps, stages; " Q smem" where Q is not held in registers,
    " l-MMA" where the tensor cores sum the rows of P (``ROWSUM_MMA``), " pinned" where the
    first key block's row max stays the reference (``PINNED_MAX``)."""
    k = cfg.kwargs
    label = f"{k['BLOCK_M']}x{k['BLOCK_N']} w{cfg.num_warps} s{cfg.num_stages}"
    if not k.get("Q_IN_REGS", True):
        label += " Q smem"
    if k.get("ROWSUM_MMA", False):
        label += " l-MMA"
    return label + " pinned" if k.get("PINNED_MAX", False) else label


def launch_config(impl: str, q, k, v, causal: bool, config, sm_scale: float | None = None,
                  out=None):
    """Run the ``impl`` kernel ("portable" or "hopper") with one ``triton.Config``, no autotune.

    Returns (o, lse, compiled): ``compiled`` is Triton's compiled kernel on a GPU (its
    ``metadata.shared`` bytes, ``n_regs``, ``n_spills``, ``asm["sass"]``), None in the
    interpreter.
    """
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    o, lse = v2.allocate_outputs(q, out)  # ``out``: preallocated (o, lse), e.g. NaN-poisoned
    blocks = dict(config.kwargs)
    if impl == "portable":  # Hopper-only switches mean nothing to the portable kernel
        blocks.pop("Q_IN_REGS", None)
        blocks.pop("ROWSUM_MMA", None)
        blocks.pop("PINNED_MAX", None)
    meta = {"HEAD_DIM": D, "CAUSAL": bool(causal), "DOT_PRECISION": v2.dot_precision(q.dtype),
            **blocks, "num_warps": config.num_warps, "num_stages": config.num_stages}
    grid_ = (triton.cdiv(N_Q, config.kwargs["BLOCK_M"]), B * H)  # the wrappers' grid
    bucket = triton.next_power_of_2(max(N_Q, N_K))
    if impl not in ("portable", "hopper"):
        raise ValueError(f"impl must be 'portable' or 'hopper', got {impl!r}")
    with interpreter_errstate():
        if impl == "portable":
            compiled = v2._flash_fwd_v2_kernel[grid_](
                q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *o.stride()[:3], sm_scale * v2.LOG2E, H, H // H_KV, N_Q, N_K, bucket, **meta)
        else:
            descs = [hop._descriptor(t, 16) for t in (q, k, v, o)]
            hop._set_block_shapes({**meta, **dict(zip(("desc_q", "desc_k", "desc_v", "desc_o"),
                                                      descs))})
            compiled = hop._flash_fwd_v2_hopper_kernel[grid_](
                *descs, lse, sm_scale * v2.LOG2E, 1.0, H, H // H_KV, N_Q, N_K, bucket, **meta)
    return o, lse, (compiled if DEVICE == "cuda" else None)


def count_instructions(sass: str, opcode: str) -> int:
    """How many SASS lines use ``opcode`` (e.g. "HGMMA", "MUFU.EX2", "UTMALDG")."""
    return sum(1 for ln in sass.splitlines() if re.search(rf"\b{re.escape(opcode)}\b", ln))
