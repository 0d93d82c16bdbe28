"""Benchmark: the course's Triton matmul against cuBLAS (torch.matmul), same process, same inputs.

    python -m course_lib.bench matmul            # fp16 and bf16 at 4096³ and a few other shapes
    python -m course_lib.bench matmul --quick    # 4096³ only

Introduced in notebooks/03_tiled_matmul.ipynb. FLOPs = 2·M·N·K; TFLOP/s = FLOPs / median time.
Each kernel is autotuned and warmed up before timing; times are medians of CUDA-event timings
(``bench.common.median_ms``). The result, with the GPU and versions, goes to
``course_lib/data/matmul.json``.
"""
from __future__ import annotations

import argparse

import torch

from course_lib.bench.common import format_table, median_ms, require_gpu, save_result

SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 2048), (4096, 4096, 1024),
          (4000, 4000, 4000), (1024, 4096, 4096))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEADLINE = ("fp16", (4096, 4096, 4096))


def measure(M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    """Time the course's matmul and torch.matmul on one shape; check they agree."""
    from course_lib.kernels.matmul import best_config, matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    b = torch.randn(K, N, device="cuda", dtype=dtype, generator=gen)
    ours = matmul(a, b)  # autotunes on first call
    ref = a.float() @ b.float()
    theirs = torch.matmul(a, b)
    err_ours = (ours.float() - ref).abs().max().item()
    err_torch = (theirs.float() - ref).abs().max().item()
    ms_ours = median_ms(lambda: matmul(a, b))
    ms_torch = median_ms(lambda: torch.matmul(a, b))
    flops = 2 * M * N * K
    return {"M": M, "N": N, "K": K, "dtype": str(dtype).replace("torch.", ""),
            "course_ms": ms_ours, "torch_ms": ms_torch,
            "course_tflops": flops / (ms_ours * 1e-3) / 1e12,
            "torch_tflops": flops / (ms_torch * 1e-3) / 1e12,
            "ratio": ms_torch / ms_ours,
            "max_err_course": err_ours, "max_err_torch": err_torch,
            "config": best_config(M, N, K, dtype)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench matmul", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4096³ only (fp16 and bf16)")
    ap.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16,bf16")
    ap.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    args = ap.parse_args(argv)
    require_gpu("the matmul benchmark")

    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = []
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {name!r}; use {', '.join(DTYPES)}")
        for M, N, K in shapes:
            row = measure(M, N, K, DTYPES[name])
            rows.append(row)
            print(f"{name} {M}x{N}x{K}: course {row['course_tflops']:.0f} TFLOP/s, torch "
                  f"{row['torch_tflops']:.0f} TFLOP/s, ratio {row['ratio']:.2f}", flush=True)
    print()
    print(format_table(rows, ["dtype", "M", "N", "K", "course_tflops", "torch_tflops", "ratio",
                              "max_err_course", "max_err_torch"], floatfmt="{:.3g}"))
    head = next((r for r in rows if r["dtype"] == "float16"
                 and (r["M"], r["N"], r["K"]) == HEADLINE[1]), None)
    if head:
        print(f"\nheadline: fp16 4096³: {head['ratio']:.2f} × cuBLAS "
              f"({head['course_tflops']:.0f} vs {head['torch_tflops']:.0f} TFLOP/s)")
    if not args.no_save:
        path = save_result("matmul", {
            "what": "course_lib.kernels.matmul.matmul vs torch.matmul (cuBLAS)",
            "flops": "2*M*N*K", "timing": "median of CUDA-event timings (triton do_bench)",
            "headline": head, "rows": rows})
        print(f"saved {path}")
    return 0
