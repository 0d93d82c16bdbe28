"""python -m course_lib.bench attention: the course's kernels against PyTorch SDPA's backends.

Introduced in notebooks/07_triton_flash_v1.ipynb and notebooks/08_triton_flash_v2.ipynb.

The sweep follows the FlashAttention-2 paper's (Dao 2023, Section 4.1, which keeps B·N = 16k
tokens) with B·N = 32k tokens, H·D = 2048, D ∈ {64, 128}, N from 512 to 16k, causal and
non-causal, fp16. In one process it times

* ``v1``: ``course_lib.kernels.flash_v1.flash_attn_v1`` (forward only),
* ``v2-<impl>``: ``flash_attn_v2(..., impl=...)`` for every impl in ``flash_v2.IMPLS``,
* ``sdpa-<BACKEND>``: ``torch.nn.functional.scaled_dot_product_attention`` with each backend
  forced (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION, and MATH where it fits),

with warm-up and the median of many runs (``common.median_ms``). Before a provider of the course
is timed at a shape, its output (backward: its gradients) on batch 0, heads 0–1 is compared with
an fp32 reference; a kernel whose error is over twice SDPA FLASH_ATTENTION's (+1e-3) is not timed.

FLOPs: forward 4·B·H·N_q·N_k·D (×½ causal), backward 2.5× forward (``reference.attention_flops``).
The backward mode times only ``torch.autograd.grad(o, (q, k, v), do, retain_graph=True)``; the
forward runs once outside the timed region.

    python -m course_lib.bench attention [--mode fwd|bwd] [--dtype fp16|bf16] [--heads-dims 64,128]
                                          [--quick] [--providers v1,v2-portable,...] [--out DIR]

Writes ``attention_<mode>.json`` and ``attention_<mode>.png`` to ``--out`` (default
course_lib/data).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from course_lib.bench.common import (
    DATA_DIR,
    SDPA_BACKENDS,
    describe_error,
    format_table,
    median_ms,
    require_gpu,
    save_result,
    sdpa_backend,
    sweep,
)
from course_lib.reference import attention_flops

TOKENS = 32 * 1024  # B·N
HIDDEN = 2048  # H·D
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
REFERENCE = "sdpa-FLASH_ATTENTION"  # the ratios' denominator
SINGLE_RUN_MS = 2000.0  # a provider slower than this once is timed once, not many times
MATH_MEMORY_FRACTION = 0.4  # MATH only where B·H·N²·(2+4) bytes (×2 backward) fit in 40% of free


def shapes(head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, tokens=TOKENS, hidden=HIDDEN,
           causal=(False, True)) -> list[dict]:
    """The sweep's shapes, grouped by (D, causal), N ascending: B = tokens // N, H = hidden // D."""
    out = []
    for d in head_dims:
        if hidden % d:
            raise ValueError(f"hidden size {hidden} is not a multiple of head dim {d}")
        for c in causal:
            for n in seq_lens:
                out.append({"B": max(1, tokens // n), "H": hidden // d, "N": n, "D": d,
                            "causal": bool(c)})
    return out


def shape_flops(shape: dict, mode: str) -> float:
    return attention_flops(shape["B"], shape["H"], shape["N"], shape["N"], shape["D"],
                           causal=shape["causal"], mode=mode)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def provider_names(mode: str, impls=()) -> list[str]:
    """Every provider of a sweep, in table order (v1 has no backward)."""
    names = [] if mode == "bwd" else ["v1"]
    names += [f"v2-{impl}" for impl in impls]
    names += [f"sdpa-{backend}" for backend in SDPA_BACKENDS]
    return names


# ----------------------------------------------------------------------------- the sweep


def run_sweep(shape_list: list[dict], providers: list[str], measure, mode: str = "fwd",
              progress: bool = True, rounds: int = 1) -> list[dict]:
    """Measure every (shape, provider); ``measure(provider, shape) -> dict`` with ``ms`` (None
    when it failed or was skipped) and optionally ``error`` and ``max_err``.

    ``measure`` is the GPU timer in a real run and a fake in the CPU tests. A provider that
    raises is recorded with its error and the sweep goes on.
    """
    def derive(shape, rec):
        rec["tflops"] = tflops(shape_flops(shape, mode), rec.get("ms"))

    def label(shape):
        return f"D={shape['D']} causal={shape['causal']} N={shape['N']}"

    return [{**shape, "flops": shape_flops(shape, mode), "results": results}
            for shape, results in sweep(shape_list, providers, measure, derive,
                                        f"attention {mode}", label, progress, rounds)]


def best_v2(row: dict) -> tuple[str | None, float | None]:
    """The fastest ``v2-*`` provider of a row and its TFLOP/s."""
    best = (None, None)
    for name, rec in row["results"].items():
        t = rec.get("tflops")
        if name.startswith("v2-") and t is not None and (best[1] is None or t > best[1]):
            best = (name, t)
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def tflops_table(result: dict) -> str:
    """Every provider's TFLOP/s at every shape."""
    providers = result["providers"]
    rows = [{"D": r["D"], "causal": str(r["causal"]), "N": r["N"], "B": r["B"], "H": r["H"],
             **{p: r["results"].get(p, {}).get("tflops") for p in providers}}
            for r in result["rows"]]
    return format_table(rows, ["D", "causal", "N", "B", "H", *providers])


def summary_rows(result: dict) -> list[dict]:
    """Per shape: the fastest v2 forward, or in a backward run the mean of the v2 columns (each
    forward's results go through the same backward kernels: the columns differ by noise)."""
    out = []
    for r in result["rows"]:
        if result["mode"] == "bwd":
            speeds = [rec["tflops"] for n, rec in r["results"].items()
                      if n.startswith("v2-") and rec.get("tflops") is not None]
            name, v2 = ("v2 (mean)", sum(speeds) / len(speeds)) if speeds else (None, None)
        else:
            name, v2 = best_v2(r)
        res = r["results"]
        ref = res.get(REFERENCE, {}).get("tflops")
        cudnn = res.get("sdpa-CUDNN_ATTENTION", {}).get("tflops")
        v1 = res.get("v1", {}).get("tflops")
        out.append({"D": r["D"], "causal": str(r["causal"]), "N": r["N"],
                    "best v2": name or "-", "v2": v2, "FA2": ref, "v2/FA2": ratio(v2, ref),
                    "cuDNN": cudnn, "v2/cuDNN": ratio(v2, cudnn), "v1": v1,
                    "v1/v2": ratio(v1, v2)})
    return out


def summary_table(result: dict) -> str:
    """The compact table printed last: best v2 against SDPA FLASH_ATTENTION (FA2) and cuDNN."""
    rows = summary_rows(result)
    cols = ["D", "causal", "N", "best v2", "v2", "FA2", "v2/FA2", "cuDNN", "v2/cuDNN"]
    if result["mode"] == "fwd":
        cols += ["v1", "v1/v2"]
    return format_table(rows, cols, floatfmt="{:.2f}")


def failures(result: dict) -> list[str]:
    return [f"D={r['D']} causal={r['causal']} N={r['N']} {p}: {rec['error']}"
            for r in result["rows"] for p, rec in r["results"].items() if rec.get("error")]


def report(result: dict) -> str:
    """What the command prints at the end: all TFLOP/s, failures, then the compact summary."""
    env = result.get("environment", {})
    head = (f"attention {result['mode']}, {result['dtype']}, TFLOP/s "
            f"(FLOPs = {result['flops_formula']}); {env.get('gpu', env.get('device', '?'))}, "
            f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}")
    rounds = result.get("rounds", 1)
    head += ("\nharness: every provider called eagerly, triton.testing.do_bench median"
             + (f" of {rounds} interleaved rounds" if rounds > 1 else ""))
    parts = [head, tflops_table(result)]
    fails = failures(result)
    if fails:
        parts.append("not timed:\n  " + "\n  ".join(fails))
    parts.append("summary: best v2 against SDPA FLASH_ATTENTION (FA2) and CUDNN_ATTENTION, "
                 "TFLOP/s and ratios\n" + summary_table(result))
    return "\n\n".join(parts)


def make_result(rows: list[dict], providers: list[str], mode: str, dtype: str) -> dict:
    formula = "4·B·H·N_q·N_k·D, ×½ causal"
    if mode == "bwd":
        formula = "2.5 × (" + formula + ")"
    return {"subject": "attention", "mode": mode, "dtype": dtype, "flops_formula": formula,
            "tokens": TOKENS, "hidden": HIDDEN, "reference": REFERENCE,
            "providers": providers, "rows": rows}


def write(result: dict, out_dir: Path | None = None, plot: bool = True) -> Path:
    """Save the JSON (with the environment) and, if asked, the PNG beside it; return its path."""
    path = save_result(f"attention_{result['mode']}", result, out_dir)
    if plot:
        from course_lib.bench.plots import plot_attention, save_figure

        save_figure(plot_attention(json.loads(path.read_text())), path.with_suffix(".png"))
    return path


# ----------------------------------------------------------------------------- GPU timing


def _v2_impls() -> tuple[tuple[str, ...], str | None]:
    try:
        from course_lib.ops import IMPLS
    except ImportError as exc:
        return (), describe_error(exc)
    return tuple(IMPLS), None


def _sdpa(backend: str, causal: bool):
    import torch.nn.functional as F

    def run(q, k, v):
        with sdpa_backend(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def provider_fn(name: str, causal: bool):
    """The callable ``(q, k, v) -> o`` behind a provider name."""
    if name == "v1":
        from course_lib.kernels.flash_v1 import flash_attn_v1

        return lambda q, k, v: flash_attn_v1(q, k, v, causal=causal)
    if name.startswith("v2-"):
        from course_lib.ops import flash_attn_v2

        impl = name[3:]
        return lambda q, k, v: flash_attn_v2(q, k, v, causal=causal, impl=impl)
    if name.startswith("sdpa-") and name[5:] in SDPA_BACKENDS:
        return _sdpa(name[5:], causal)
    raise ValueError(f"unknown provider {name!r}")


def autotuned_configs() -> list[dict]:
    """The config the portable kernel's autotuner chose in this process, per key, for the result
    file (the Hopper kernel looks its config up: ``flash_v2_hopper.hopper_config``)."""
    from course_lib.kernels import flash_v2

    out = []
    for kernel, tuner in (("portable", flash_v2._portable_tuned),):
        for key, cfg in getattr(tuner, "cache", {}).items():
            named = dict(zip(tuner.keys, key))
            out.append({"kernel": kernel, **{k: named[k] for k in ("N_BUCKET", "HEAD_DIM", "CAUSAL")
                                             if k in named},
                        "config": {**cfg.kwargs, "num_warps": cfg.num_warps,
                                   "num_stages": cfg.num_stages}})
    return out


def math_fits(shape: dict, mode: str, free_bytes: int) -> bool:
    """Whether SDPA MATH's N×N scores and probabilities fit: B·H·N²·(2+4) bytes (×2 backward)."""
    need = shape["B"] * shape["H"] * shape["N"] ** 2 * (2 + 4) * (2 if mode == "bwd" else 1)
    return need < MATH_MEMORY_FRACTION * free_bytes


class GPUMeasure:
    """``measure(provider, shape)`` for ``run_sweep`` on a GPU: check once, then time.

    ``provider(name, causal)`` gives the callable ``(q, k, v) -> o`` behind a provider name
    (default: this module's ``provider_fn``; ``bench.hopper`` passes its fixed configs).
    """

    def __init__(self, mode: str, dtype: torch.dtype, warmup_ms: float = 100,
                 rep_ms: float = 500, check: bool = True, provider=None):
        self.mode, self.dtype, self.check = mode, dtype, check
        self.provider = provider_fn if provider is None else provider
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self._key, self._inputs, self._ref = None, None, None
        self._checked = {}  # provider -> its max error at the current shape (checked once)

    # inputs and the fp32 reference are made once per shape
    def _prepare(self, shape: dict):
        key = tuple(sorted(shape.items()))
        if key == self._key:
            return
        self._key = self._inputs = self._ref = None
        self._checked = {}
        torch.cuda.empty_cache()
        B, H, N, D = shape["B"], shape["H"], shape["N"], shape["D"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=self.dtype, generator=gen)
                   for _ in range(3))
        do = torch.randn(B, H, N, D, device="cuda", dtype=self.dtype, generator=gen)
        self._inputs = (q, k, v, do)
        self._key = key

    def _reference(self, shape):
        """fp32 output (and gradients) on batch 0, heads 0-1, and SDPA FLASH's errors on them."""
        if self._ref is None:
            from course_lib.reference import attention

            q, k, v, do = (t[:1, :2] for t in self._inputs)
            qf, kf, vf = (t.float().requires_grad_(self.mode == "bwd") for t in (q, k, v))
            o = attention(qf, kf, vf, causal=shape["causal"])
            ref = [o.detach()]
            if self.mode == "bwd":
                ref += [g.detach() for g in torch.autograd.grad(o, (qf, kf, vf), do.float())]
            base = self._outputs(self.provider(REFERENCE, shape["causal"]), q, k, v, do)
            self._ref = (ref, [_max_err(b, r) for b, r in zip(base, ref)])
        return self._ref

    def _outputs(self, fn, q, k, v, do):
        if self.mode == "fwd":
            return [fn(q, k, v).detach()]
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = fn(q, k, v)
        return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

    def _validate(self, name, shape) -> float:
        ref, base_errs = self._reference(shape)
        q, k, v, do = (t[:1, :2] for t in self._inputs)
        outs = self._outputs(self.provider(name, shape["causal"]), q, k, v, do)
        errs = [_max_err(o, r) for o, r in zip(outs, ref)]
        for what, err, base in zip(("o", "dq", "dk", "dv"), errs, base_errs):
            if not err <= 2 * base + 1e-3:  # also catches NaN
                raise AssertionError(f"wrong {what}: max err {err:.2e} against the fp32 "
                                     f"reference, SDPA FLASH_ATTENTION's is {base:.2e}")
        return max(errs)

    def __call__(self, name: str, shape: dict) -> dict:
        if name == "v1" and self.mode == "bwd":
            return {"ms": None, "error": "skipped: v1 has no backward"}
        if name == "sdpa-MATH" and not math_fits(shape, self.mode, torch.cuda.mem_get_info()[0]):
            return {"ms": None, "error": "skipped: MATH's N×N matrices do not fit in memory"}
        self._prepare(shape)
        rec = {}
        if self.check and not name.startswith("sdpa-"):
            if name not in self._checked:  # later rounds of the same shape time only
                self._checked[name] = self._validate(name, shape)
            rec["max_err"] = self._checked[name]
        q, k, v, do = self._inputs
        fn = self.provider(name, shape["causal"])
        if self.mode == "fwd":
            def step():
                return fn(q, k, v)
        else:
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = fn(qg, kg, vg)  # the forward, once, outside the timed region
            if o.grad_fn is None:
                return {"ms": None, "error": "no backward (output has no grad_fn)"}

            def step():
                return torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
        rec["ms"] = self._time(step)
        return rec

    def _time(self, step) -> float:
        step()  # compile / pick algorithms
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        once = start.elapsed_time(end)
        if once > SINGLE_RUN_MS:  # slow (v1 at long N): one run is the measurement
            return once
        return median_ms(step, warmup_ms=self.warmup_ms, rep_ms=self.rep_ms)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.float() - b.float()).abs().max().item()
    return float("inf") if math.isnan(d) else d


# ----------------------------------------------------------------------------- command line


def _csv(text: str, cast=str) -> list:
    return [cast(x) for x in text.replace(" ", ",").split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench attention",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    ap.add_argument("--heads-dims", "--head-dims", dest="head_dims", default="64,128",
                    help="head dims D, comma-separated (default 64,128)")
    ap.add_argument("--quick", action="store_true", help="N in {1k, 4k, 16k} only")
    ap.add_argument("--seq-lens", default=None,
                    help="N values, comma-separated (overrides --quick)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="B·N (default 32768)")
    ap.add_argument("--providers", nargs="+", default=None,
                    help="subset of: v1 v2-<impl> sdpa-FLASH_ATTENTION sdpa-CUDNN_ATTENTION "
                         "sdpa-EFFICIENT_ATTENTION sdpa-MATH (comma or space separated)")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="where the JSON and PNG go")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the numerics check")
    ap.add_argument("--warmup-ms", type=float, default=100)
    ap.add_argument("--rep-ms", type=float, default=500)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every provider of a shape this many times, interleaved, and keep "
                         "each one's median (default 1; the stored sweep used 3)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    require_gpu("python -m course_lib.bench attention")
    impls, why = _v2_impls()
    if why:
        print(f"note: no v2 providers ({why})")
    everything = provider_names(args.mode, impls)
    if args.providers:
        wanted = [p for chunk in args.providers for p in _csv(chunk)]
        unknown = [p for p in wanted if p not in everything]
        if unknown:
            raise SystemExit(f"unknown providers {unknown}; this run knows {everything}")
        everything = [p for p in everything if p in wanted]
    seq = (_csv(args.seq_lens, int) if args.seq_lens else
           QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    shape_list = shapes(_csv(args.head_dims, int), seq, tokens=args.tokens, causal=causal)
    measure = GPUMeasure(args.mode, DTYPES[args.dtype], args.warmup_ms, args.rep_ms,
                         check=not args.no_check)
    rows = run_sweep(shape_list, everything, measure, mode=args.mode, rounds=args.rounds)
    result = make_result(rows, everything, args.mode, args.dtype)
    result["tokens"] = args.tokens
    result["rounds"] = args.rounds
    if args.mode == "fwd" and impls:
        try:
            result["autotuned"] = autotuned_configs()
        except Exception as exc:  # noqa: BLE001 - a bookkeeping extra must not lose the sweep
            result["autotuned"] = describe_error(exc)
    path = write(result, args.out, plot=not args.no_plot)
    print(f"wrote {path}" + ("" if args.no_plot else f" and {path.with_suffix('.png')}"))
    print(report(json.loads(path.read_text())))  # the compact summary is printed last
    return 0
