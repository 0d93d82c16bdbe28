"""Drop-in attention: host overhead, decode eager and under CUDA graphs, padded head dims.

    python -m course_lib.bench dropin [--out course_lib/data/dropin.json]
    python -m course_lib.bench dropin --dispatch --out course_lib/data/dispatch.json

Three measurements, each with one harness for both sides (course kernels and PyTorch SDPA):

* ``decode``: one query token, H 32, H_kv 8, D 128, fp16, at four shapes (B 1 and N 4k or
  128k, B 8 and N 4k, B 64 and N 2k).
  Ours: ``flash_decode`` with its default arguments (no value read back), with
  ``validate=True`` (which reads ``cache_seqlens`` back: one synchronisation), a planned step
  (``plan.run``) and that step replayed as a CUDA graph. SDPA's cuDNN and FLASH backends eager
  and as CUDA graphs, each in the faster of its two GQA layouts (course_lib.bench.decode).
  Every time is ``triton.testing.do_bench``'s median (CUDA events, L2 flushed between calls).
* ``host``: the CPU time of one call with the GPU idle: after a synchronisation, ``n`` calls
  back to back, (t1 − t0) / n by ``time.perf_counter``, median of 5 rounds. Tiny shapes, so the
  GPU never holds the host back.
* ``head_dims``: the forward at D 64, 80, 96, 128 (80 and 96 run padded to 128 columns) against
  SDPA FLASH_ATTENTION and cuDNN, both eager, do_bench median.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time

import torch
import torch.nn.functional as F
import triton

from course_lib._launch import bind
from course_lib.bench.common import (
    DATA_DIR,
    copy_bandwidth_gbs,
    environment,
    graph_median_ms,
    median_ms,
    require_gpu,
    sdpa_backend,
)

DECODE_SHAPES = [(1, 4096), (1, 131072), (8, 4096), (64, 2048)]
H, H_KV, D = 32, 8, 128


def host_us(fn, n: int = 200, rounds: int = 5) -> float:
    """CPU µs per call of ``fn`` with the GPU idle at the start (median of ``rounds``)."""
    for _ in range(20):
        fn()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / n * 1e6)
    return sorted(out)[rounds // 2]


def _sdpa_decode_fns(q, k, v):
    """SDPA in the two GQA layouts (rows: (B, H_kv, G, D) queries; gqa: enable_gqa=True)."""
    B = q.shape[0]
    G = H // H_KV
    q_rows = q.view(B, H_KV, G, D)  # one query token: the G heads of a group as G rows
    return {"rows": lambda: F.scaled_dot_product_attention(q_rows, k, v),
            "gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}


def _decode_inputs(B: int, N: int):
    """q (B, H, 1, D), full caches (B, H_kv, N, D) fp16 and lengths N, seeded by the shape."""
    g = torch.Generator(device="cuda").manual_seed(B * 7 + N)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(B, H_KV, N, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(B, H_KV, N, D, device="cuda", dtype=torch.float16, generator=g)
    return q, k, v, torch.full((B,), N, dtype=torch.int32, device="cuda")


def decode_rows(shapes=DECODE_SHAPES) -> list[dict]:
    from course_lib.ops import flash_decode, plan_decode

    rows = []
    for B, N in shapes:
        q, k, v, lens = _decode_inputs(B, N)
        plan = plan_decode(q, k, v)
        fns = {
            "ours_default": lambda: flash_decode(q, k, v, lens),
            "ours_validate": lambda: flash_decode(q, k, v, lens, validate=True),
            "ours_plan": lambda: plan.run(q, k, v, lens),
        }
        row = {"B": B, "N": N, "num_splits": plan.num_splits}
        for name, fn in fns.items():
            row[f"{name}_us"] = median_ms(fn) * 1e3
        row["ours_graph_us"] = graph_median_ms(fns["ours_plan"]) * 1e3
        kv_bytes = 2 * B * H_KV * N * D * 2
        row["ours_graph_gbs"] = kv_bytes / (row["ours_graph_us"] * 1e-6) / 1e9
        for backend, short in (("CUDNN_ATTENTION", "cudnn"), ("FLASH_ATTENTION", "flash")):
            best = None
            for layout, fn in _sdpa_decode_fns(q, k, v).items():
                with sdpa_backend(backend):
                    try:
                        eager = median_ms(fn) * 1e3
                        graph = graph_median_ms(fn) * 1e3
                    except RuntimeError as e:  # a backend that refuses this layout
                        print(f"  {short} {layout}: {str(e).splitlines()[0][:80]}")
                        continue
                if best is None or graph < best[1]:
                    best = (eager, graph, layout)
            if best is not None:
                row[f"sdpa_{short}_us"] = best[0]
                row[f"sdpa_{short}_graph_us"] = best[1]
                row[f"sdpa_{short}_layout"] = best[2]
        # the host's time per call, GPU idle
        row["host_ours_default_us"] = host_us(fns["ours_default"])
        row["host_ours_plan_us"] = host_us(fns["ours_plan"])
        layout = row.get("sdpa_cudnn_layout", "gqa")
        with sdpa_backend("CUDNN_ATTENTION"):
            row["host_sdpa_cudnn_us"] = host_us(_sdpa_decode_fns(q, k, v)[layout])
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def host_in_turns(fns: dict, backends: dict | None = None, rounds: int = 7) -> dict:
    """Host µs per call of each of ``fns`` ({name: fn}), GPU idle at the start: the functions
    take turns, ``rounds`` times, 200 calls each (``host_us``), and each gets the median of its
    rounds. Turns put the host's drift (seconds long, tens of percent on these machines) on
    every side alike. ``backends``: {name: SDPA backend} for the SDPA calls."""
    backends = backends or {}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            with sdpa_backend(backends[name]) if name in backends else contextlib.nullcontext():
                times[name].append(host_us(fn, rounds=1))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _tiny_inputs():
    """The host rows' shapes, small enough that the GPU never holds the host back: q, k, v of a
    forward (B 1, H 4, H_kv 2, N 128, D 64) and qd, kd, lens of a decode step (H 32, H_kv 8,
    256 cached keys, D 128), fp16."""
    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    qd = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    kd = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.float16)
    lens = torch.full((1,), 256, dtype=torch.int32, device="cuda")
    return q, k, v, qd, kd, lens


@triton.jit
def _nop_kernel(X):
    pass


def _sdpa_host_fns(q, k, v) -> tuple[dict, dict]:
    """({name: SDPA call}, {name: its backend}) for ``host_in_turns``: FLASH and cuDNN."""
    fns, backends = {}, {}
    for backend, short in (("FLASH_ATTENTION", "flash"), ("CUDNN_ATTENTION", "cudnn")):
        fns[f"sdpa_{short}_us"] = lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)
        backends[f"sdpa_{short}_us"] = backend
    return fns, backends


def host_rows() -> dict:
    """Host µs per call at tiny shapes, in turns (``host_in_turns``): flash_attn_v2 (each
    impl), SDPA, a planned decode step, flash_decode."""
    from course_lib.ops import IMPLS, flash_attn_v2, flash_decode, plan_decode

    q, k, v, qd, kd, lens = _tiny_inputs()
    fns = {f"flash_attn_v2_{impl or 'auto'}_us":
           lambda impl=impl: flash_attn_v2(q, k, v, causal=True, impl=impl)
           for impl in (None, *IMPLS)}
    sdpa, backends = _sdpa_host_fns(q, k, v)
    fns |= sdpa
    plan = plan_decode(qd, kd, kd)
    fns["plan_run_us"] = lambda: plan.run(qd, kd, kd, lens)
    fns["flash_decode_us"] = lambda: flash_decode(qd, kd, kd, lens)
    fns["flash_decode_validate_us"] = lambda: flash_decode(qd, kd, kd, lens, validate=True)
    # The floors: one kernel launched by PyTorch (a one-element fill: a real launch; a tensor of
    # no element launches none), and a bound launch of a Triton kernel that does nothing.
    one = torch.zeros(1, device="cuda")
    fns["torch_kernel_launch_us"] = one.zero_
    nop = bind(1, _nop_kernel, (1,), one)  # None where Triton's own launch is the only path
    fns["triton_nop_launch_us"] = (functools.partial(nop, one.data_ptr()) if nop is not None
                                   else lambda: _nop_kernel[(1,)](one))
    with torch.inference_mode():
        out = host_in_turns(fns, backends)
    print(out, flush=True)
    return out


def head_dim_rows(dims=(64, 80, 96, 128), B=4, N=4096, Hq=16) -> list[dict]:
    from course_lib.ops import flash_attn_v2

    rows = []
    for d in dims:
        for causal in (False, True):
            q, k, v = (torch.randn(B, Hq, N, d, device="cuda", dtype=torch.float16)
                       for _ in range(3))
            flops = 4 * B * Hq * N * N * d / (2 if causal else 1)
            row = {"D": d, "causal": causal, "B": B, "N": N, "H": Hq}
            ours = median_ms(lambda: flash_attn_v2(q, k, v, causal=causal))
            row["ours_ms"] = ours
            for backend, short in (("FLASH_ATTENTION", "flash"), ("CUDNN_ATTENTION", "cudnn")):
                with sdpa_backend(backend):
                    try:
                        row[f"sdpa_{short}_ms"] = median_ms(
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    except RuntimeError as e:
                        print(f"  {short} D {d}: {str(e).splitlines()[0][:80]}")
            row["ours_tflops"] = flops / (ours * 1e-3) / 1e12
            print(row, flush=True)
            rows.append(row)
    return rows


def sweep_rows(shapes=DECODE_SHAPES, configs=None, rep_ms: float = 150,
               merges=None) -> list[dict]:
    """Paired sweep of the decode step under CUDA graphs: every launch config of
    ``bench.decode.TUNE_CONFIGS`` with each merge (fused into the split kernel, or a second
    kernel), between two timings of SDPA cuDNN (start and end: the drift of the run)."""
    from course_lib.bench.decode import TUNE_CONFIGS
    from course_lib.kernels import decode as kd

    configs = TUNE_CONFIGS if configs is None else configs
    merges = kd.MERGES if merges is None else merges
    rows = []
    for B, N in shapes:
        q, k, v, lens = _decode_inputs(B, N)
        out = torch.empty_like(q)
        lse = torch.empty(B, H, 1, device="cuda")
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        cudnn = _sdpa_decode_fns(q, k, v)["gqa"]
        row = {"B": B, "N": N, "trials": []}
        with sdpa_backend("CUDNN_ATTENTION"):
            row["cudnn_graph_us_start"] = graph_median_ms(cudnn, rep_ms=rep_ms) * 1e3
        for merge in merges:
            for cfg in configs:
                plan = kd.make_plan(B, H, H_KV, 1, D, N, q.device, config=cfg, merge=merge)
                def step(plan=plan):
                    kd.run_plan(plan, q, k, v, lens, None, D ** -0.5, out, lse)

                step()
                err = (out.float() - ref.float()).abs().max().item()
                t = graph_median_ms(step, rep_ms=rep_ms) * 1e3
                row["trials"].append({"merge": merge, **cfg, "num_splits": plan.num_splits,
                                      "graph_us": t, "max_err": err})
        with sdpa_backend("CUDNN_ATTENTION"):
            row["cudnn_graph_us_end"] = graph_median_ms(cudnn, rep_ms=rep_ms) * 1e3
        best = min(row["trials"], key=lambda r: r["graph_us"])
        print(f"B {B} N {N}: cuDNN {row['cudnn_graph_us_start']:.1f}/"
              f"{row['cudnn_graph_us_end']:.1f} µs; best {best}", flush=True)
        for merge in merges:
            b = min((r for r in row["trials"] if r["merge"] == merge),
                    key=lambda r: r["graph_us"])
            print(f"   best {merge}: {b['graph_us']:.1f} µs {b}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def host_breakdown() -> dict:
    """Where the host time of one fast launch goes (µs per call, GPU idle)."""
    from course_lib import _launch
    from course_lib.kernels import decode as kd
    from course_lib.ops import plan_decode

    qd = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    kd_ = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.float16)
    lens = torch.full((1,), 256, dtype=torch.int32, device="cuda")
    out = {"fast": _launch.FAST}
    for merge in kd.MERGES:
        plan = plan_decode(qd, kd_, kd_, merge=merge)
        out[f"plan_run_{merge}_us"] = host_us(lambda plan=plan: plan.run(qd, kd_, kd_, lens))
    args = list(range(20)) + [qd] * 6
    drv = _launch._driver.active
    dev = drv.get_current_device()
    out["pointers_26_args_us"] = host_us(lambda: _launch._pointers(args))
    out["current_device_us"] = host_us(drv.get_current_device)
    out["current_stream_us"] = host_us(lambda: drv.get_current_stream(dev))
    print(out, flush=True)
    return out


def dispatch_rows(rounds: int = 7) -> dict:
    """Host µs per call of one operator registered two ways, paired: ``torch.library.Library``
    (``torch.ops.course.*``, as the course registers them) against the ``custom_op`` decorator
    over the same implementation (registered here as ``bench_dispatch::*``), and the
    implementation called directly; SDPA at the same shape for scale. Inference mode, as a
    compiled prefill runs. The variants take turns, ``rounds`` times; medians of the rounds."""
    from course_lib.ops import attention as oa
    from course_lib.ops import decode as od

    lib = "bench_dispatch"
    if not hasattr(getattr(torch.ops, lib), "flash_attn_fwd"):  # once per process
        def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                sm_scale: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
            return oa._flash_attn_v2_forward(q, k, v, causal, sm_scale,
                                             None if impl == "auto" else impl)

        def dec(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor | None, num_splits: int,
                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
            return od._op_call(q, k_cache, v_cache, cache_seqlens, None, num_splits, sm_scale,
                               -1, 0.0, None, None)

        torch.library.custom_op(f"{lib}::flash_attn_fwd", fwd, mutates_args=()) \
            .register_fake(oa._flash_attn_fwd_fake)
        torch.library.custom_op(f"{lib}::flash_decode", dec, mutates_args=()) \
            .register_fake(od._fake_outputs)
    ops = getattr(torch.ops, lib)
    q, k, v, qd, kd, lens = _tiny_inputs()
    fwd_args, dec_args = (q, k, v, True, 0.125, "auto"), (qd, kd, kd, lens, 0, 128 ** -0.5)
    fns = {
        "flash_attn_fwd_library_us": lambda: torch.ops.course.flash_attn_fwd(*fwd_args),
        "flash_attn_fwd_custom_op_us": lambda: ops.flash_attn_fwd(*fwd_args),
        "flash_attn_fwd_direct_us": lambda: oa._flash_attn_v2_forward(q, k, v, True, 0.125),
        "flash_decode_library_us": lambda: torch.ops.course.flash_decode(*dec_args),
        "flash_decode_custom_op_us": lambda: ops.flash_decode(*dec_args),
        "flash_decode_direct_us": lambda: od._op_call(qd, kd, kd, lens, None, 0, 128 ** -0.5,
                                                      -1, 0.0, None, None),
    }
    sdpa, backends = _sdpa_host_fns(q, k, v)
    fns |= sdpa
    with torch.inference_mode():
        out = host_in_turns(fns, backends, rounds)
    print(out, flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench dropin")
    parser.add_argument("--out", default=str(DATA_DIR / "dropin.json"))
    parser.add_argument("--sweep", action="store_true",
                        help="only the paired sweep of decode configs and merges (and where a "
                             "launch's host time goes), written to --out")
    parser.add_argument("--dispatch", action="store_true",
                        help="only the operators' host time by registration, paired, "
                             "written to --out")
    args = parser.parse_args(argv)
    require_gpu("the drop-in benchmark")
    if args.dispatch:
        result = {"environment": environment(),
                  "harness": {"host": "CPU time per call, GPU idle: 200 calls back to back "
                                      "after a synchronisation; the variants take turns, 7 "
                                      "rounds, median"},
                  "host": dispatch_rows()}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
        return 0
    if args.sweep:
        result = {"environment": environment(),
                  "harness": "CUDA-graph replay of each side, triton.testing.do_bench median, "
                             "L2 flushed; SDPA cuDNN timed before and after the trials",
                  "host": host_breakdown(), "decode": sweep_rows()}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
        return 0
    result = {"environment": environment(),
              "harness": {"timer": "triton.testing.do_bench, median, L2 flushed between calls; "
                                   "eager: both sides called eagerly; graph: both sides "
                                   "replayed as CUDA graphs",
                          "host": "CPU time per call, GPU idle: 200 calls back to back after a "
                                  "synchronisation; the tiny-shape calls take turns, 7 rounds, "
                                  "median; the decode rows' host columns, median of 5 rounds"},
              "decode_shape": {"H": H, "H_kv": H_KV, "D": D, "N_q": 1, "dtype": "float16"}}
    result["copy_gbs"] = copy_bandwidth_gbs()
    result["host"] = host_rows()
    result["decode"] = decode_rows()
    result["head_dims"] = head_dim_rows()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def report(result: dict) -> str:
    """The stored run as three small tables (decode, host time, head dims), as text."""
    env = result["environment"]
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}",
             "decode (N_q 1, H 32, H_kv 8, D 128, fp16), µs; do_bench median, L2 flushed",
             f"{'':>11} | {'eager, both sides':^35} | {'CUDA graphs':^15} | host µs per call",
             f"{'B':>3} {'N':>7} | {'default':>8} {'validate':>8} {'planned':>8} {'cuDNN':>7}"
             f" | {'planned':>7} {'cuDNN':>7} | {'default':>7} {'plan':>4} {'cuDNN':>5}"]
    for r in result["decode"]:
        lines.append(
            f"{r['B']:>3} {r['N']:>7} | {r['ours_default_us']:>8.1f} {r['ours_validate_us']:>8.1f}"
            f" {r['ours_plan_us']:>8.1f} {r['sdpa_cudnn_us']:>7.1f} | {r['ours_graph_us']:>7.1f}"
            f" {r['sdpa_cudnn_graph_us']:>7.1f} | {r['host_ours_default_us']:>7.0f}"
            f" {r['host_ours_plan_us']:>4.0f} {r['host_sdpa_cudnn_us']:>5.0f}")
    h = result["host"]
    lines += ["", "host time of one call at a tiny shape, GPU idle (µs):",
              f"  flash_attn_v2 portable {h['flash_attn_v2_portable_us']:.0f}, Hopper kernel "
              f"{h['flash_attn_v2_hopper_us']:.0f}; SDPA FLASH {h['sdpa_flash_us']:.0f}, "
              f"cuDNN {h['sdpa_cudnn_us']:.0f}",
              f"  planned decode step {h['plan_run_us']:.0f}, flash_decode "
              f"{h['flash_decode_us']:.0f}, with validate=True {h['flash_decode_validate_us']:.0f};"
              f" one PyTorch kernel launch {h['torch_kernel_launch_us']:.0f}, a Triton kernel"
              f" that does nothing, bound {h['triton_nop_launch_us']:.0f}",
              "", "forward, B 4, H 16, N 4k, fp16, ms (eager, both sides):",
              f"{'D':>4} {'causal':>6} | {'ours':>6} {'FLASH':>6} {'cuDNN':>6} | FLASH/ours"]
    for r in result["head_dims"]:
        lines.append(f"{r['D']:>4} {str(r['causal']):>6} | {r['ours_ms']:>6.3f} "
                     f"{r['sdpa_flash_ms']:>6.3f} {r['sdpa_cudnn_ms']:>6.3f} | "
                     f"{r['sdpa_flash_ms'] / r['ours_ms']:.2f}×")
    return "\n".join(lines)
