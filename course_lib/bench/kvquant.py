"""A decode step over an 8-bit KV cache (int8, FP8 e4m3; a scale per token and head) against the
fp16 cache, on the GPU.

``python -m course_lib.bench kvquant``: ``flash_decode`` and ``paged_decode`` (pages of 16 in a
random order) with the same queries over the same keys and values, stored in fp16 or quantised
by ``course_lib.kvquant.quantize_kv``; every provider through the same harness (``in_turns``:
once to compile, then rounds in turns, ``do_bench`` median). Also each quantised output's
largest difference from the fp16 cache's. Result: course_lib/data/kv_quant.json.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from course_lib.bench.common import in_turns, require_gpu, save_result

H, H_KV, D = 32, 8, 128
SHAPES = [(1, 32768), (8, 32768), (1, 131072), (8, 131072)]  # B, N


def rows(rounds: int = 5, shapes=SHAPES) -> list[dict]:
    from course_lib.kvcache import contiguous_to_pages
    from course_lib.kvquant import kv_bytes_per_token, quantize_kv
    from course_lib.ops import flash_decode, paged_decode

    def paged(x):
        """Pages of 16 of a cache (B, H_kv, N, D) or of its scales (B, H_kv, N), every tensor in
        the same random order (one seed): (pages, block_table)."""
        pages, table = contiguous_to_pages(x if x.ndim == 4 else x[..., None], block_size=16,
                                           generator=torch.Generator().manual_seed(1))
        return (pages if x.ndim == 4 else pages[..., 0].contiguous()), table

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, N in shapes:
        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16, generator=g)
        k = torch.randn(B, H_KV, N, D, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(B, H_KV, N, D, device="cuda", dtype=torch.float16, generator=g)
        fns, caches = {}, {"fp16": (k, v, None, None)}
        for name, dtype in (("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)):
            (kq, ks), (vq, vs) = quantize_kv(k, dtype), quantize_kv(v, dtype)
            caches[name] = (kq, vq, ks, vs)
        for name, (kc, vc, ks, vs) in caches.items():
            scales = {} if ks is None else {"k_scale": ks, "v_scale": vs}
            fns[f"flash_decode {name}"] = (
                lambda kc=kc, vc=vc, s=scales: flash_decode(q, kc, vc, **s))
            kp, table = paged(kc)
            vp, _ = paged(vc)
            pscales = {} if ks is None else {"k_scale": paged(ks)[0], "v_scale": paged(vs)[0]}
            lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
            fns[f"paged_decode {name}"] = (
                lambda kp=kp, vp=vp, t=table, s=pscales: paged_decode(q, kp, vp, t, lens, **s))
        ref = fns["flash_decode fp16"]().float()
        diffs = {name: (fn().float() - ref).abs().max().item() for name, fn in fns.items()}
        times, errors = in_turns(fns, rounds=rounds, rep_ms=100)
        ms = {name: statistics.median(t) for name, t in times.items() if t}
        speedup = {name: ms[f"{name.split()[0]} fp16"] / t for name, t in ms.items()}
        row = {"B": B, "N": N, "H": H, "H_kv": H_KV, "D": D, "rounds_ms": times,
               "errors": errors, "ms": ms, "speedup_over_fp16": speedup,
               "max_abs_diff_from_fp16": diffs,
               "bytes_per_token": {name: kv_bytes_per_token(H_KV, D, dt) for name, dt in
                                   (("fp16", torch.float16), ("int8", torch.int8),
                                    ("e4m3", torch.float8_e4m3fn))}}
        print(f"B {B} N {N}: " + "  ".join(f"{name} {t * 1e3:.1f} us (x{speedup[name]:.2f})"
                                          for name, t in ms.items()), flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench kvquant",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    require_gpu("the quantized KV cache benchmark")
    result = {"method": __doc__, "rows": rows(args.rounds)}
    print("saved", save_result("kv_quant", result))
    return 0
