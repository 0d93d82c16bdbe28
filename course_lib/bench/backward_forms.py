"""The backward in two forms on a GPU: the course's two kernels (dK/dV, then dQ: seven matmuls
per block pair, no atomics) against FlashAttention-2's one pass (dQ added by the dK/dV kernel
with fp32 atomic adds: five matmuls), beside SDPA's cuDNN and FLASH backends.

    python -m course_lib.bench backward_forms [--out FILE]

fp16, B·N = 32k, H·D = 2048, D 64 and 128, N 1k, 4k and 16k, causal and not. Every provider
is timed the same way: its forward runs once outside the timing, and the timed call is
``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)``; ``triton.testing.do_bench``
median, the providers in turns, 3 rounds, the median kept. FLOPs: 2.5 × 4·B·H·N²·D (×½
causal). Each provider's gradients are compared with the two kernels' (the largest absolute
difference is stored). Then whether five runs of each give the same bits (D 128, N 4k, causal).
Writes course_lib/data/backward_forms.json.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from course_lib.bench.common import median_ms, require_gpu, save_result, sdpa_backend
from course_lib.kernels.flash_bwd import flash_attn_v2_backward
from course_lib.ops import flash_attn_v2

TOKENS, HIDDEN = 32768, 2048
SHAPES = [(d, n, c) for d in (64, 128) for n in (1024, 4096, 16384) for c in (False, True)]


class _OnePass(torch.autograd.Function):
    """flash_attn_v2's forward, and its backward with ``one_pass=True``."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_attn_v2(q.detach(), k.detach(), v.detach(), causal, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = flash_attn_v2_backward(do, q, k, v, o, lse, ctx.causal, q.shape[-1] ** -0.5,
                                       one_pass=True)
        return (*grads, None)


def providers(causal: bool) -> dict:
    def sdpa(backend):
        def run(q, k, v):
            with sdpa_backend(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=causal)
        return run

    return {"two kernels": lambda q, k, v: flash_attn_v2(q, k, v, causal),
            "one pass": lambda q, k, v: _OnePass.apply(q, k, v, causal),
            "cuDNN": sdpa("CUDNN_ATTENTION"), "FLASH": sdpa("FLASH_ATTENTION")}


def _inputs(B, H, N, D):
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4))
    return (*(t.requires_grad_() for t in (q, k, v)), do)


def measure(D: int, N: int, causal: bool, rounds: int = 3) -> dict:
    B, H = TOKENS // N, HIDDEN // D
    q, k, v, do = _inputs(B, H, N, D)
    outputs, ref, row = {}, None, {"D": D, "N": N, "causal": causal, "B": B, "H": H}
    for name, fn in providers(causal).items():
        o = outputs[name] = fn(q, k, v)
        grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        ref = ref or grads
        row[name] = {"max_abs_diff": max(float((a.float() - b.float()).abs().max())
                                         for a, b in zip(grads, ref))}
    times = {name: [] for name in outputs}
    for _ in range(rounds):
        for name, o in outputs.items():
            times[name].append(median_ms(
                lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)))
    flops = 2.5 * 4 * B * H * N * N * D * (0.5 if causal else 1)
    for name, ts in times.items():
        ms = statistics.median(ts)
        row[name].update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    return row


def same_bits(runs: int = 5) -> dict:
    """Whether ``runs`` backward runs of each provider give the same bits (D 128, N 4k, causal)."""
    torch.manual_seed(1)
    q, k, v, do = _inputs(8, 16, 4096, 128)
    result = {}
    for name, fn in providers(True).items():
        o = fn(q, k, v)
        first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        result[name] = all(
            all(torch.equal(a, b) for a, b in zip(first, torch.autograd.grad(
                o, (q, k, v), do, retain_graph=True))) for _ in range(runs - 1))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench backward_forms")
    parser.add_argument("--out", help="directory of the JSON file (default course_lib/data)")
    args = parser.parse_args(argv)
    require_gpu("the backward forms benchmark")
    torch.manual_seed(0)
    rows = []
    for D, N, causal in SHAPES:
        rows.append(measure(D, N, causal))
        r = rows[-1]
        print(f"D {D:3d} N {N:5d} {'causal' if causal else 'full  '}  " + "  ".join(
            f"{name} {r[name]['tflops']:5.0f}" for name in providers(causal)), flush=True)
    bits = same_bits()
    print("the same bits in 5 runs:", bits)
    path = save_result("backward_forms", {"rows": rows, "same_bits_D128_N4k_causal": bits},
                       args.out)
    print("wrote", path)
    return 0
