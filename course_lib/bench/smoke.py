"""A short benchmark for ``./course gpu-check``: is the GPU path as fast as it should be?

Against PyTorch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends, one harness for both sides
(``triton.testing.do_bench`` median, CUDA events, L2 flushed; the providers take turns, 3
rounds, the median of each kept; eager calls, or CUDA-graph replays where the table says graph):

* forward, fp16, B 4, H 16, N 4096, D 128, causal: ``flash_attn_v2(q, k, v, causal=True)``;
* backward at the same shape: ``torch.autograd.grad`` of that output;
* decode, fp16, N_q 1, H 32, H_kv 8, D 128, B and N in (1, 4k), (1, 128k), (8, 4k),
  (8, 128k), (64, 2k): ``flash_decode(q, k, v, lens)`` and a planned step against SDPA cuDNN,
  eagerly and as CUDA-graph replays.

FLOPs: forward 4·B·H·N_q·N_k·D (×½ causal), backward 2.5× the forward. Decode: the K/V bytes
read (2·B·H_kv·N·D·2) over the time, against the copy bandwidth measured in the same run, timed
twice: by ``do_bench``, and after a flush that leaves no dirty line in the L2
(``common.clean_l2_median_ms``), the copy timed the same way. The
full sweeps are ``python -m course_lib.bench attention|decode|dropin``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.bench.common import (
    clean_l2_median_ms,
    copy_bandwidth_gbs,
    graphed,
    median_ms,
    sdpa_backend,
)
from course_lib.reference import attention_flops

SDPA = {"FLASH": "FLASH_ATTENTION", "cuDNN": "CUDNN_ATTENTION"}
ROUNDS = 3


def _in_turns(fns: dict, rep_ms: float = 100, clean_l2: bool = False) -> dict:
    """Median ms of each of ``fns`` ({name: (fn, backend or None)}), the fns taking turns;
    ``clean_l2``: timed by ``clean_l2_median_ms`` instead of ``do_bench``."""
    def timed(fn):
        if clean_l2:
            return clean_l2_median_ms(fn)
        return median_ms(fn, warmup_ms=25, rep_ms=rep_ms)

    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, (fn, backend) in fns.items():
            if backend is None:
                times[name].append(timed(fn))
            else:
                with sdpa_backend(backend):
                    times[name].append(timed(fn))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _attention_rows() -> list[dict]:
    from course_lib.ops import flash_attn_v2

    B, H, N, D = 4, 16, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g,
                           requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours():
        return flash_attn_v2(q, k, v, causal=True)

    ref = sdpa().float()
    err = (ours().float() - ref).abs().max().item()
    rows = []
    for mode in ("forward", "backward"):
        fns = {}
        for name, fn, backend in (("ours", ours, None), *((n, sdpa, b) for n, b in SDPA.items())):
            if mode == "forward":
                fns[name] = (fn, backend)
            else:
                def grad(fn=fn, backend=backend):
                    if backend is None:
                        o = fn()
                    else:
                        with sdpa_backend(backend):
                            o = fn()
                    return torch.autograd.grad(o, (q, k, v), do)
                fns[name] = (grad, backend)
        ms = _in_turns(fns)
        flops = attention_flops(B, H, N, N, D, causal=True) * (2.5 if mode == "backward" else 1)
        rows.append({"what": f"{mode}, B {B} H {H} N {N} D {D} causal, fp16",
                     "unit": "TFLOP/s", "ms": ms,
                     "rate": {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()},
                     "max_err_vs_sdpa": err if mode == "forward" else None})
    return rows


DECODE_SHAPES = [(1, 4096), (1, 131072), (8, 4096), (8, 131072), (64, 2048)]
DECODE_PROVIDERS = ("flash_decode", "cuDNN", "flash_decode graph", "plan.run graph",
                    "cuDNN graph")


def _decode_rows(copy_gbs: float, copy_clean_gbs: float) -> list[dict]:
    """Decode at N_q 1, H 32, H_kv 8, D 128, fp16, full caches: ``flash_decode`` with its
    default arguments and SDPA cuDNN (``enable_gqa=True``), each called eagerly and replayed as
    a CUDA graph, and a planned step (``plan_decode``, ``plan.run``) replayed as a graph; timed
    by ``do_bench`` (``us``) and again after a flush that leaves the L2 clean (``us_clean_l2``,
    set against the copy timed the same way)."""
    from course_lib.ops import flash_decode, plan_decode

    H, H_kv, D = 32, 8, 128
    rows = []
    for B, N in DECODE_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(B * 7 + N)
        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16, generator=g)
        k = torch.randn(B, H_kv, N, D, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(B, H_kv, N, D, device="cuda", dtype=torch.float16, generator=g)
        lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
        plan = plan_decode(q, k, v)

        def ours():
            return flash_decode(q, k, v, lens)

        def cudnn():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def planned():
            return plan.run(q, k, v, lens)

        with sdpa_backend("CUDNN_ATTENTION"):
            want = cudnn().float()
        err = max((f().float() - want).abs().max().item() for f in (ours, planned))
        fns = {"flash_decode": (ours, None), "cuDNN": (cudnn, "CUDNN_ATTENTION"),
               "flash_decode graph": (_graph(ours), None),
               "plan.run graph": (_graph(planned), None),
               "cuDNN graph": (_graph(cudnn, "CUDNN_ATTENTION"), None)}
        ms = _in_turns(fns, rep_ms=60)
        clean = _in_turns(fns, clean_l2=True)
        nbytes = 2 * B * H_kv * N * D * 2
        rows.append({"B": B, "N": N, "num_splits": plan.num_splits,
                     "config": plan.plan.config, "us": {n: t * 1e3 for n, t in ms.items()},
                     "kv_read_over_copy": {n: nbytes / (t * 1e-3) / 1e9 / copy_gbs
                                           for n, t in ms.items()},
                     "us_clean_l2": {n: t * 1e3 for n, t in clean.items()},
                     "kv_read_over_copy_clean_l2": {n: nbytes / (t * 1e-3) / 1e9 / copy_clean_gbs
                                                    for n, t in clean.items()},
                     "max_err_vs_cudnn": err})
    return rows


def _graph(fn, backend=None):
    """A CUDA graph of ``fn()`` (captured after three warm-up calls on a side stream); returns
    its replay."""
    def call():
        if backend is None:
            return fn()
        with sdpa_backend(backend):
            return fn()

    return graphed(call)


def smoke() -> dict:
    """The attention rows (ms, rate, SDPA time / ours: above 1, ours is faster) and the decode
    table (µs per provider, K/V bytes read over the copy bandwidth measured in the same run)."""
    copy_gbs = copy_bandwidth_gbs()
    copy_clean_gbs = copy_bandwidth_gbs(timer=clean_l2_median_ms)
    rows = _attention_rows()
    for row in rows:
        row["sdpa_time_over_ours"] = {n: row["ms"][n] / row["ms"]["ours"] for n in SDPA}
    torch.cuda.empty_cache()
    return {"harness": "triton.testing.do_bench median (L2 flushed), providers in turns, "
                       f"{ROUNDS} rounds, median kept; eager calls, and CUDA-graph replays where "
                       "a provider says graph",
            "copy_gbs": copy_gbs, "copy_clean_l2_gbs": copy_clean_gbs, "rows": rows,
            "decode": _decode_rows(copy_gbs, copy_clean_gbs)}


def table(result: dict) -> str:
    lines = [f"{'attention':<52} {'ours':>7} {'FLASH':>7} {'cuDNN':>7}  "
             "SDPA time / ours (FLASH, cuDNN)"]
    for row in result["rows"]:
        r, x = row["rate"], row["sdpa_time_over_ours"]
        lines.append(f"{row['what'] + ' (' + row['unit'] + ')':<52} {r['ours']:>7.0f} "
                     f"{r['FLASH']:>7.0f} {r['cuDNN']:>7.0f}  {x['FLASH']:.2f}, {x['cuDNN']:.2f}")
    lines.append(f"decode, µs (N_q 1, H 32, H_kv 8, D 128, fp16; copy bandwidth "
                 f"{result['copy_gbs']:.0f} GB/s, read + write)")
    lines.append(f"{'B, N':<10}" + "".join(f"{p:>20}" for p in DECODE_PROVIDERS)
                 + "   ours / cuDNN (eager, graph)")
    for row in result["decode"]:
        us = row["us"]
        graph = min(us["flash_decode graph"], us["plan.run graph"])
        lines.append(f"{row['B']:>2}, {row['N']:<6}"
                     + "".join(f"{us[p]:>20.1f}" for p in DECODE_PROVIDERS)
                     + f"   {us['flash_decode'] / us['cuDNN']:.3f}, "
                       f"{graph / us['cuDNN graph']:.3f}")
    lines.append("decode, KV bytes read / copy bandwidth: do_bench's flush / a flush that leaves "
                 "the L2 clean")
    for row in result["decode"]:
        if "kv_read_over_copy_clean_l2" in row:
            a, c = row["kv_read_over_copy"], row["kv_read_over_copy_clean_l2"]
            lines.append(f"{row['B']:>2}, {row['N']:<6}" + "".join(
                f"{f'{a[p]:.2f} / {c[p]:.2f}':>20}" for p in DECODE_PROVIDERS))
    return "\n".join(lines)
