"""python -m course_lib.bench memory: GPU memory of attention's forward + backward, measured.

Introduced in notebooks/10_backward.ipynb. Standard attention keeps the N × N probabilities P
(and more) from the forward for the backward; FlashAttention keeps O and the log-sum-exp and
recomputes P block by block. This benchmark measures what that saves, with PyTorch's allocator:

* ``saved``: memory still allocated after the forward, minus the inputs: what autograd keeps
  for the backward (plus O itself);
* ``peak``: ``torch.cuda.max_memory_allocated()`` over forward + backward
  (``torch.autograd.grad``), minus the inputs (q, k, v, dO) that exist before it starts.

Providers: ``sdpa-MATH`` (PyTorch's plain attention: stores P), ``sdpa-FLASH_ATTENTION``
(PyTorch's FlashAttention-2: stores the lse) and ``flash_attn_v2`` (the course's kernels).
Shapes: N from 1k to 16k, B = 1, H = 16, D = 64, fp16, non-causal (options below). A provider
that runs out of memory is recorded as None.

    python -m course_lib.bench memory [--seq-lens 1024,2048,...] [--batch 1] [--heads 16]
                                       [--head-dim 64] [--dtype fp16|bf16] [--causal]
                                       [--providers sdpa-MATH,flash_attn_v2] [--out DIR]

Writes ``memory.json`` (``save_result``); ``plot_memory`` draws it, ``FIGURES["bwd_memory"]``
draws the stored file.
"""
from __future__ import annotations

import argparse
import gc

import torch
from matplotlib.figure import Figure

from course_lib.bench.common import (
    format_table,
    load_result,
    require_gpu,
    save_result,
    sdpa_backend,
)

SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
PROVIDERS = ("sdpa-MATH", "sdpa-FLASH_ATTENTION", "flash_attn_v2")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MIB = 2**20


def _attention_fn(provider: str, causal: bool):
    """A function (q, k, v) -> O for one provider, differentiable."""
    if provider == "flash_attn_v2":
        from course_lib.ops import flash_attn_v2

        return lambda q, k, v: flash_attn_v2(q, k, v, causal=causal)
    if provider.startswith("sdpa-"):
        backend = provider[len("sdpa-"):]

        def sdpa(q, k, v):
            with sdpa_backend(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return sdpa
    raise ValueError(f"unknown provider {provider!r}; choose from {PROVIDERS}")


def measure(provider: str, B: int, H: int, N: int, D: int, dtype=torch.float16,
            causal: bool = False) -> dict | None:
    """Bytes kept for the backward (``saved_bytes``) and the forward + backward peak
    (``peak_bytes``), both above the inputs' own memory; None if it ran out of memory."""
    fn = _attention_fn(provider, causal)
    gen = torch.Generator(device="cuda").manual_seed(N)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    try:  # warm-up: compile and autotune first, so the autotuner's buffers stay out of the peak
        torch.autograd.grad(fn(q, k, v), (q, k, v), do)
    except torch.cuda.OutOfMemoryError:
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        o = fn(q, k, v)
        torch.cuda.synchronize()
        saved = torch.cuda.memory_allocated() - base
        grads = torch.autograd.grad(o, (q, k, v), do)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del o, grads
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del q, k, v, do
        gc.collect()
        torch.cuda.empty_cache()
    return {"saved_bytes": int(saved), "peak_bytes": int(peak)}


def predicted_bytes(B: int, H: int, N: int, D: int, bytes_per_el: int = 2) -> dict:
    """The model's numbers: P is B·H·N² elements; O is B·H·N·D; the lse B·H·N fp32."""
    return {"p_bytes": B * H * N * N * bytes_per_el, "o_bytes": B * H * N * D * bytes_per_el,
            "lse_bytes": B * H * N * 4}


def run(seq_lens=SEQ_LENS, B=1, H=16, D=64, dtype="fp16", causal=False, providers=PROVIDERS):
    rows = []
    for N in seq_lens:
        row = {"N": N, "B": B, "H": H, "D": D, "causal": causal,
               **predicted_bytes(B, H, N, D, torch.finfo(DTYPES[dtype]).bits // 8),
               "results": {}}
        for p in providers:
            row["results"][p] = measure(p, B, H, N, D, DTYPES[dtype], causal)
        rows.append(row)
        cells = {p: (f"{r['peak_bytes'] / MIB:.0f}" if r else "OOM")
                 for p, r in row["results"].items()}
        print(f"N={N:>6}: peak MiB " + ", ".join(f"{p} {c}" for p, c in cells.items()),
              flush=True)
    return {"mode": "fwd+bwd", "dtype": dtype, "providers": list(providers), "rows": rows,
            "metric": "bytes above the inputs (q, k, v, dO): saved = after the forward, "
                      "peak = max over forward + backward (torch.cuda.max_memory_allocated)"}


def table(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        out = {"N": str(r["N"]), "P (MiB)": r["p_bytes"] / MIB}
        for p in result["providers"]:
            m = r["results"].get(p)
            out[f"{p} peak"] = m["peak_bytes"] / MIB if m else None
            out[f"{p} saved"] = m["saved_bytes"] / MIB if m else None
        rows.append(out)
    cols = ["N", "P (MiB)"] + [f"{p} {w}" for p in result["providers"] for w in ("peak", "saved")]
    return format_table(rows, cols, floatfmt="{:.0f}")


def plot_memory(result: dict) -> Figure:
    """Peak memory (solid) and memory kept for the backward (dashed) against N, log-log."""
    fig = Figure(figsize=(6.6, 4.3), layout="constrained")
    ax = fig.subplots()
    colors = {"sdpa-MATH": "tab:brown", "sdpa-FLASH_ATTENTION": "tab:blue",
              "flash_attn_v2": "tab:red"}
    for p in result["providers"]:
        for key, ls, what in (("peak_bytes", "-", "peak"), ("saved_bytes", "--", "kept")):
            pts = [(r["N"], r["results"][p][key] / MIB) for r in result["rows"]
                   if r["results"].get(p)]
            if pts:
                ax.plot(*zip(*pts), ls, marker="o", color=colors.get(p, "k"),
                        label=f"{p} ({what})")
    ns = [r["N"] for r in result["rows"]]
    ax.plot(ns, [r["p_bytes"] / MIB for r in result["rows"]], ":", color="gray",
            label="one N × N matrix P")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
    r0 = result["rows"][0]
    env = result.get("environment", {})
    ax.set(xlabel="sequence length N", ylabel="MiB above the inputs",
           title=f"forward + backward memory, B={r0['B']} H={r0['H']} D={r0['D']} "
                 f"{result['dtype']}\n{env.get('gpu', env.get('device', '?'))}, "
                 f"torch {env.get('torch', '?')}")
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=7)
    return fig


def _stored_figure():
    result = load_result("memory")
    return None if result is None else plot_memory(result)


FIGURES = {"bwd_memory": _stored_figure}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--out", default=None, help="directory of memory.json (course_lib/data)")
    args = ap.parse_args(argv)
    require_gpu("the memory benchmark")
    providers = [p for p in args.providers.split(",") if p]
    for p in providers:
        if p not in PROVIDERS:
            ap.error(f"unknown provider {p!r}; choose from {PROVIDERS}")
    result = run([int(n) for n in args.seq_lens.split(",")], args.batch, args.heads,
                 args.head_dim, args.dtype, args.causal, providers)
    print(table(result))
    path = save_result("memory", result, args.out)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
