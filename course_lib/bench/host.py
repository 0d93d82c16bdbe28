"""The public calls' host time, and the GPU speed beside it, for one Triton and one tree.

    python -m course_lib.bench host --out FILE [--gpu] [--off-path]

``host``: the CPU time of one call with the GPU idle, at tiny shapes (``dropin.host_rows``:
``flash_attn_v2`` by implementation, a planned decode step, ``flash_decode``, SDPA's FLASH and
cuDNN backends, and the floors: a PyTorch kernel launch and a bound Triton no-op launch), the
calls taking turns, 7 rounds of 200 calls, median. ``--gpu`` adds the smoke benchmark
(``smoke.smoke``: forward, backward and decode against SDPA, one harness for both sides) and a
variants row (sliding window (1024, 0), bf16, B 2, H 16, N 16k, D 128, forward, against the same
call's dense causal run). Run it once per Triton version and per tree (the previous commit's
``course_lib`` on ``PYTHONPATH``, then this one's, in turns) to compare a change of the host
path: SDPA's rows are the yardstick each process measures for itself.
"""
from __future__ import annotations

import argparse
import json

import torch

from course_lib.bench.common import environment, median_ms, require_gpu


def variants_row() -> dict:
    """ms of the sliding-window forward and of the dense causal one, in turns, 3 rounds."""
    from course_lib.ops import flash_attn_v2

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 16, 16384, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    fns = {"window_1024_ms": lambda: flash_attn_v2(q, k, v, causal=True, window_size=(1024, 0)),
           "causal_ms": lambda: flash_attn_v2(q, k, v, causal=True)}
    times = {n: [] for n in fns}
    for _ in range(3):
        for n, fn in fns.items():
            times[n].append(median_ms(fn, warmup_ms=25, rep_ms=100))
    return {n: sorted(t)[1] for n, t in times.items()}


def off_path_rows() -> dict:
    """Host µs per call, in turns, of the calls beside the dense one: ``flash_attn_v2`` with a
    window, with a softcap, and on inputs that require grad (the forward only), at the host
    rows' tiny shape; ``flash_decode`` over 32 caches of 1000 to 1031 keys in turn (a cache
    that grows by a token per call); the dense call and SDPA for scale."""
    import torch.nn.functional as F

    from course_lib.bench.dropin import host_in_turns
    from course_lib.ops import flash_attn_v2, flash_decode

    q, k, v = (torch.randn(1, h, 128, 64, device="cuda", dtype=torch.float16) for h in (4, 2, 2))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    qd = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    caches = [torch.randn(1, 8, n, 128, device="cuda", dtype=torch.float16)
              for n in range(1000, 1032)]
    step = iter(range(1 << 62))
    fns = {"window_us": lambda: flash_attn_v2(q, k, v, causal=True, window_size=(64, 0)),
           "softcap_us": lambda: flash_attn_v2(q, k, v, causal=True, softcap=30.0),
           "grad_forward_us": lambda: flash_attn_v2(qg, kg, vg, causal=True),
           "growing_decode_us": lambda: flash_decode(qd, *[caches[next(step) % 32]] * 2),
           "dense_us": lambda: flash_attn_v2(q, k, v, causal=True),
           "sdpa_us": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)}
    return host_in_turns(fns)


def main(argv=None) -> int:
    from course_lib.bench.dropin import host_rows

    parser = argparse.ArgumentParser(prog="python -m course_lib.bench host")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpu", action="store_true", help="also the GPU speed tables")
    parser.add_argument("--off-path", action="store_true",
                        help="also the calls beside the dense one (off_path_rows)")
    args = parser.parse_args(argv)
    require_gpu("the host-time benchmark")
    result = {"environment": environment(), "host": host_rows()}
    if args.off_path:
        result["off_path"] = off_path_rows()
    if args.gpu:
        from course_lib.bench.smoke import smoke
        result["smoke"] = smoke()
        result["variants"] = variants_row()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
