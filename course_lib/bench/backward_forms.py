"""The backward in two forms on a GPU: the course's two kernels (dK/dV, then dQ: seven matmuls
per block pair, no atomics) against FlashAttention-2's one pass (dQ added by the dK/dV kernel
with fp32 atomic adds: five matmuls), beside SDPA's cuDNN and FLASH backends.

    python -m course_lib.bench backward_forms [--tiles] [--out FILE]

fp16, B·N = 32k, H·D = 2048, D 64 and 128, N 1k, 4k and 16k, causal and not. Every provider
is timed the same way: its forward runs once outside the timing, and the timed call is
``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)``; ``triton.testing.do_bench``
median, the providers in turns, 3 rounds, the median kept. FLOPs: 2.5 × 4·B·H·N²·D (×½
causal). Each provider's gradients are compared with the two kernels' (the largest absolute
difference is stored). Then whether five runs of each give the same bits (D 128, N 4k, causal).
Writes course_lib/data/backward_forms.json.

``--tiles`` first times each kernel of the two-kernel form on its own, at every candidate tile of
its head dim (``DKDV_CONFIGS``, ``DQ_CONFIGS``) and at the named configs before and after the
sweep that chose D 128's: ``torch.profiler``'s device time of each kernel, mean of 10 calls
after 3 warm-up calls. Writes course_lib/data/backward_tiles.json.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from course_lib.bench.common import in_turns, require_gpu, save_result, sdpa_backend
from course_lib.kernels import flash_bwd
from course_lib.kernels.flash_bwd import BwdConfig, flash_attn_v2_backward
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
    times, errors = in_turns({name: lambda o=o: torch.autograd.grad(o, (q, k, v), do,
                                                                    retain_graph=True)
                              for name, o in outputs.items()}, rounds)
    if errors:  # every provider ran once above: none should fail now
        raise RuntimeError(f"D {D}, N {N}, causal {causal}: {errors}")
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


# The named configs before the tile sweep (D 64's is still the named one)
NAMED_BEFORE = {64: BwdConfig(32, 128, 128, 32, 2, warps_kv=4, stages_kv=5, warps_q=4, stages_q=5),
                128: BwdConfig(32, 128, 128, 32, 2, warps_kv=8, stages_kv=3, warps_q=8, stages_q=3)}
TILE_SHAPES = [(16384, False), (16384, True), (4096, True), (1024, False)]


def kernel_us(fn, reps: int = 10) -> dict:
    """Mean device time (µs) of each kernel ``fn()`` launches, from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {"dkdv": 0.0, "dq": 0.0, "other": 0.0}
    for e in prof.key_averages():
        kind = "dkdv" if "_bwd_dkdv" in e.key else "dq" if "_bwd_dq" in e.key else "other"
        times[kind] += e.self_device_time_total / reps
    return times


def _candidates(configs, D):
    """(BLOCK_M, BLOCK_N, warps, stages) of the autotuner's candidates for head dim D."""
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            for c in flash_bwd.keep_bwd_config_for_head_dim(configs, {"HEAD_DIM": D})]


def tile_rows(D: int) -> list[dict]:
    """Each backward kernel's time at each candidate tile (the other kernel at the named
    config's tile), and both at the named configs and under the autotuner."""
    named = flash_bwd.gpu_config(D)
    runs = {"default": None, "named before": NAMED_BEFORE[D], "named": named}
    for m, n, w, s in _candidates(flash_bwd.DKDV_CONFIGS, D):
        runs[f"dkdv {m}x{n} w{w} s{s}"] = BwdConfig(m, n, named.block_m2, named.block_n2, 2, w, s,
                                                    named.warps_q, named.stages_q)
    for m, n, w, s in _candidates(flash_bwd.DQ_CONFIGS, D):
        runs[f"dq {m}x{n} w{w} s{s}"] = BwdConfig(named.block_m1, named.block_n1, m, n, 2,
                                                  named.warps_kv, named.stages_kv, w, s)
    rows = []
    for N, causal in TILE_SHAPES:
        B, H = TOKENS // N, HIDDEN // D
        q, k, v, do = (t.detach() for t in _inputs(B, H, N, D))
        o, lse = flash_attn_v2(q, k, v, causal, return_lse=True)
        args = (do, q, k, v, o, lse, causal, D ** -0.5)
        row = {"D": D, "N": N, "causal": causal}
        for name, cfg in runs.items():
            row[name] = kernel_us(lambda cfg=cfg: flash_attn_v2_backward(*args, config=cfg))
        rows.append(row)
        print(f"D {D:3d} N {N:5d} {'causal' if causal else 'full  '} " + "  ".join(
            f"{name}: {t['dkdv']:.0f}+{t['dq']:.0f}" for name, t in row.items()
            if isinstance(t, dict)), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench backward_forms")
    parser.add_argument("--out", help="directory of the JSON file (default course_lib/data)")
    parser.add_argument("--tiles", action="store_true", help="first each kernel's tiles")
    args = parser.parse_args(argv)
    require_gpu("the backward forms benchmark")
    torch.manual_seed(0)
    if args.tiles:
        tiles = tile_rows(64) + tile_rows(128)
        print("wrote", save_result("backward_tiles", {"rows": tiles}, args.out))
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
