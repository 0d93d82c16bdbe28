"""The variants' forward (kernels.flash_variants) on a GPU: causal, sliding window, softcap,
ALiBi and sinks against the course's dense kernels and FlexAttention, one harness, in turns.

    python -m course_lib.bench variants [--out course_lib/data/variants_fwd.json]

B 2, H 16, N 16k, D 128, bf16 (issue 21's shape). Every provider is called eagerly and timed by
``triton.testing.do_bench`` (median, L2 flushed), 7 rounds in turns (A B C ..., A B C ...), the
median of its rounds kept. TFLOP/s count the visited area only: 4·B·H·D per (query, key) pair a
row sees (``course_lib.masks.visible``), so a window's throughput compares with the dense
kernel's on equal terms. FlexAttention (``torch.nn.attention.flex_attention``) is compiled once
per mask and score modification, its block mask made once, outside the timing.
"""
from __future__ import annotations

import argparse
import json

import torch

from course_lib.bench.common import DATA_DIR, describe_error, environment, median_ms, require_gpu
from course_lib.masks import visible_pairs

B, H, N, D = 2, 16, 16384, 128
WINDOW = 1024
SOFTCAP = 30.0


def _providers(q, k, v):
    from course_lib.kernels.flash_variants import forward_variants
    from course_lib.ops import flash_attn_v2

    scale = D ** -0.5
    slopes = torch.rand(H, device="cuda") * 0.1
    sinks = torch.randn(H, device="cuda")
    causal, window = (-1, 0), (WINDOW, 0)

    def ours(window_, softcap=0.0, alibi=None, sink=None):
        return lambda: forward_variants(q, k, v, scale, window_, softcap, alibi, sink,
                                        store_lse=False)

    fns = {  # name: (fn, window the FLOPs count)
        "variants causal": (ours(causal), causal),
        f"variants window {WINDOW}": (ours(window), window),
        "variants causal softcap": (ours(causal, SOFTCAP), causal),
        "variants causal alibi": (ours(causal, alibi=slopes), causal),
        "variants causal sinks": (ours(causal, sink=sinks), causal),
        "flash_attn_v2 causal (portable)": (
            lambda: flash_attn_v2(q, k, v, causal=True, impl="portable"), causal),
        "flash_attn_v2 causal (auto)": (lambda: flash_attn_v2(q, k, v, causal=True), causal),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)

        def causal_mod(b, h, i, j):
            return j <= i

        def window_mod(b, h, i, j):
            return (j <= i) & (i - j <= WINDOW)

        for name, mod, w in (("flex causal", causal_mod, causal),
                             (f"flex window {WINDOW}", window_mod, window)):
            bm = create_block_mask(mod, None, None, N, N, device="cuda")
            fns[name] = (lambda bm=bm: flex(q, k, v, block_mask=bm), w)
    except Exception as exc:  # an older torch: recorded, the rest goes on
        print("FlexAttention unavailable:", describe_error(exc))
    return fns


def run(rounds: int = 7) -> dict:
    require_gpu("the variants benchmark")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    fns = _providers(q, k, v)
    times, errors = {name: [] for name in fns}, {}
    for name, (fn, _) in fns.items():  # compile, autotune and check once, outside the rounds
        try:
            fn()
        except Exception as exc:
            errors[name] = describe_error(exc)
    for _ in range(rounds):
        for name, (fn, _) in fns.items():
            if name not in errors:
                times[name].append(median_ms(fn, rep_ms=200))
    rows = []
    for name, (_, window) in fns.items():
        ms = sorted(times[name])[len(times[name]) // 2] if times[name] else None
        flops = 4.0 * B * H * D * visible_pairs(N, N, window)
        rows.append({"provider": name, "window": list(window), "ms": ms, "rounds_ms": times[name],
                     "tflops_visited": flops / (ms * 1e-3) / 1e12 if ms else None,
                     "error": errors.get(name)})
        print(rows[-1]["provider"], ms, rows[-1]["tflops_visited"], errors.get(name), flush=True)
    return {"environment": environment(),
            "shape": {"B": B, "H": H, "N": N, "D": D, "dtype": "bf16", "window": WINDOW,
                      "softcap": SOFTCAP},
            "method": __doc__.strip().split("\n\n")[-1].replace("\n", " "), "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench variants")
    parser.add_argument("--out", default=str(DATA_DIR / "variants_fwd.json"))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    result = run(args.rounds)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    by = {r["provider"]: r for r in result["rows"]}
    c, w = by["variants causal"]["ms"], by[f"variants window {WINDOW}"]["ms"]
    print(f"window {WINDOW} / full causal speed-up: {c / w:.2f}x (visited area "
          f"{visible_pairs(N, N, (-1, 0)) / visible_pairs(N, N, (WINDOW, 0)):.2f}x smaller)")
    return 0
