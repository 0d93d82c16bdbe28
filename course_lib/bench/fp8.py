"""The FP8 forward against our fp16 forward and SDPA's cuDNN backend, on a GPU.

    python -m course_lib.bench fp8 [--tiles] [--out FILE]

fp16 inputs, B·N = 32k, H·D = 2048, D 64 and 128, N 1k, 4k and 16k, causal and not. Timed the
same way for every provider (``common.in_turns``: each called once, then 3 rounds in turns of
``median_ms``, the median kept): ``fp8`` the FP8 kernel on inputs already in e4m3
(``kernels.flash_fp8.forward_fp8``: how FlashAttention-3's FP8 speed is reported), ``fp8 with
quantization`` the whole ``ops.flash_attn_fp8`` call (rotation and quantization included),
``fp16`` ``flash_attn_v2`` (its default kernel), ``cuDNN`` SDPA's CUDNN_ATTENTION; each row
records the FP8 kernel's tile (BLOCK_M, BLOCK_N, warps, stages). FLOPs 4·B·H·N²·D (×½ causal). With
``--tiles``: the FP8 kernel's candidate tiles at D 128 and 64, N 16k, in turns. Writes
course_lib/data/fp8_fwd.json.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from course_lib.bench.common import in_turns, require_gpu, save_result, sdpa_backend
from course_lib.kernels.flash_fp8 import forward_fp8, fp8_config, prepare_fp8
from course_lib.ops import flash_attn_fp8, flash_attn_v2

TOKENS, HIDDEN = 32768, 2048
SHAPES = [(d, n, c) for d in (64, 128) for n in (1024, 4096, 16384) for c in (False, True)]
# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried with --tiles, at D 64 and 128
TILE_CANDIDATES = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (128, 256, 8, 2),
                   (64, 128, 4, 3), (64, 128, 4, 2), (64, 128, 4, 4), (64, 256, 4, 2),
                   (64, 64, 4, 3)]


def _inputs(D, N):
    B, H = TOKENS // N, HIDDEN // D
    return [torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3)]


def _median_ms(fns: dict) -> dict:
    """{name: median ms of 3 rounds in turns, or the error that kept it from running}."""
    times, errors = in_turns(fns)
    return {name: errors.get(name) or statistics.median(times[name]) for name in fns}


def shape_rows() -> list[dict]:
    rows = []
    for D, N, causal in SHAPES:
        q, k, v = _inputs(D, N)
        x = prepare_fp8(q, k, v)
        scale = D ** -0.5

        def cudnn():
            with sdpa_backend("CUDNN_ATTENTION"):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=causal)

        ms = _median_ms({"fp8": lambda: forward_fp8(x, causal, scale, store_lse=False),
                        "fp8 with quantization": lambda: flash_attn_fp8(q, k, v, causal),
                        "fp16": lambda: flash_attn_v2(q, k, v, causal), "cuDNN": cudnn})
        failed = {name: t for name, t in ms.items() if isinstance(t, str)}
        if failed:
            raise RuntimeError(f"D {D}, N {N}, causal {causal}: {failed}")
        flops = 4 * q.shape[0] * q.shape[1] * N * N * D / (2 if causal else 1)
        row = {"D": D, "N": N, "causal": causal, "tile": list(fp8_config(D, causal)), "ms": ms,
               "tflops": {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}}
        print(D, N, causal, {n: round(t) for n, t in row["tflops"].items()}, flush=True)
        rows.append(row)
    return rows


def tile_rows(D: int, N: int = 16384) -> list[dict]:
    q, k, v = _inputs(D, N)
    fns, prepared = {}, {}
    for bm, bn, warps, stages in TILE_CANDIDATES:
        x = prepared.setdefault((bm, bn), prepare_fp8(q, k, v, blocks=(bm, bn)))
        for causal in (False, True):
            fns[(bm, bn, warps, stages, causal)] = (
                lambda x=x, c=causal, ws=(warps, stages): forward_fp8(
                    x, c, D ** -0.5, store_lse=False, warps_stages=ws))
    ms = _median_ms(fns)  # a candidate that does not compile or fit: its error
    rows = []
    for (bm, bn, warps, stages, causal), t in ms.items():
        flops = 4 * q.shape[0] * q.shape[1] * N * N * D / (2 if causal else 1)
        rows.append({"D": D, "N": N, "tile": [bm, bn, warps, stages], "causal": causal,
                     "ms": t if isinstance(t, float) else None,
                     "tflops": flops / (t * 1e-3) / 1e12 if isinstance(t, float) else None,
                     "error": t if isinstance(t, str) else None})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench fp8")
    parser.add_argument("--tiles", action="store_true", help="also the FP8 kernel's tiles")
    parser.add_argument("--out", default=None, help="directory (default course_lib/data)")
    args = parser.parse_args(argv)
    require_gpu("the FP8 benchmark")
    result = {"rows": shape_rows()}
    if args.tiles:
        result["tiles"] = tile_rows(128) + tile_rows(64)
    print(f"wrote {save_result('fp8_fwd', result, args.out)}")
    return 0
