"""python -m course_lib.bench decode: decode attention at memory bandwidth, against SDPA.

Introduced in notebooks/12_flash_decoding.ipynb (paged: notebooks/13_paged_attention.ipynb).

The sweep: one new query token (N_q = 1), B ∈ {1, 8}, N ∈ {4k, 32k, 128k} cached tokens,
H = 32 query heads, H_kv = 8 (GQA, groups of 4), D = 128, fp16. In one process it measures the
device-to-device copy bandwidth (``common.copy_bandwidth_gbs``: bytes read + written), then
times at every shape

* ``flash_decode`` (``course_lib.kernels.decode``): split-KV + LSE merge;
* ``paged_decode``: the same cache scattered into 16-token pages in a random physical order;
* ``flash_attn_v2``: the course's prefill kernel (lesson 08) called with the one query row: its
  grid has one program per (query block, head), B·H programs at N_q = 1, whatever N is;
* ``sdpa-FLASH_ATTENTION``, ``sdpa-CUDNN_ATTENTION``, ``sdpa-MATH``: PyTorch's
  ``scaled_dot_product_attention`` with one backend forced. GQA at N_q = 1 is handed to SDPA in
  two layouts, and each backend keeps the faster: the G = H/H_kv query heads of a group as G
  query *rows* of their K/V head (q viewed as (B, H_kv, G, D), no mask, the way FlashAttention's
  own decode path does it), and q (B, H, 1, D) with ``enable_gqa=True``. A backend that refuses
  a shape is recorded with its error and ``None``.

One harness for both sides. Every provider's output on batch 0 is checked against the fp32
reference before it is timed (error in the JSON). Times are medians of
``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, so even the 16 MB cache of
N = 4k comes from HBM), taken for *every* provider in two harnesses: replaying a CUDA graph of
the call (``ms``: the GPU's time, as a serving loop runs a decode step) and calling it eagerly
(``ms_eager``: Python and launch overhead included, which at N = 4k can be larger than the
kernels' own time). A ratio is only ever taken between two times of the same harness. The
course's kernels are timed with ``validate=False`` in both; ``ms_eager_default`` adds their
eager time with ``validate=True`` (host-side checks that read the lengths and block ids back:
the default when the stored sweep ran; the default now reads nothing back on a GPU, and
``python -m course_lib.bench dropin`` times each way of calling).

Reported per (shape, provider): latency in µs; KV bandwidth = bytes of K and V read
(2·B·H_kv·N·D·2) / latency, in TB/s; and that bandwidth as a fraction of the measured copy
bandwidth. FLOPs (not the limit here): 4·B·H·N_q·N·D.

    python -m course_lib.bench decode [--quick] [--tune] [--out DIR] [--no-check]

``--quick``: B = 1 only (N ∈ {4k, 32k, 128k}: both speed targets). ``--tune``: before the
sweep, try every ``TUNE_CONFIGS`` and a few split counts at B = 1 (4k and 128k) and
B = 8, 32k, print the best, and use them (written to decode_tune.json).
Writes ``decode.json`` and ``decode.png`` to ``--out`` (default course_lib/data).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from course_lib.bench.common import (
    DATA_DIR,
    copy_bandwidth_gbs,
    describe_error,
    format_table,
    graph_median_ms,
    load_result,
    median_ms,
    require_gpu,
    save_result,
    sdpa_backend,
    sweep,
)

H, H_KV, D, N_Q = 32, 8, 128, 1
BATCHES = (1, 8)
SEQ_LENS = (4096, 32768, 131072)
PROVIDERS = ("flash_decode", "paged_decode", "flash_attn_v2", "sdpa-FLASH_ATTENTION",
             "sdpa-CUDNN_ATTENTION", "sdpa-MATH")
BLOCK_SIZE = 16
SDPA_LAYOUTS = ("rows", "gqa")
HARNESS = {
    "timer": "triton.testing.do_bench, median, L2 flushed between calls",
    "ms": "CUDA-graph replay of one call (GPU time; every provider)",
    "ms_eager": "plain eager calls (host overhead included; every provider)",
    "ms_eager_default": "eager calls of the course's kernels with default arguments "
                        "(validate=True: host-side checks)",
    "sdpa_layouts": "SDPA timed with q as GQA rows (B, H_kv, G*N_q, D) and with "
                    "enable_gqa=True (B, H, N_q, D); each backend keeps its faster layout",
}
TARGETS = {  # the speed targets the sweep reports against (GPU: H100 or H200)
    "bw_fraction_b1_128k": 0.85,       # flash_decode KV bandwidth / copy bandwidth, B=1, N=128k
    "bw_fraction_b1_128k_goal": 0.92,
    "latency_vs_cudnn_b1_4k": 1.2,     # flash_decode latency / CUDNN_ATTENTION's, B=1, N=4k
    "paged_vs_flash": 1.10,            # paged_decode latency / flash_decode's, every shape
}


# The launch configs ``--tune`` and the drop-in sweep try (for D = 128); the kernels' own choice
# (kernels.decode.pick_config) is one of them.
TUNE_CONFIGS = [
    dict(BLOCK_N=bn, num_warps=w, num_stages=s)
    for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
    if not (bn == 128 and s == 4)  # 2 × 128 × 128 × 2 B × 4 stages = 256 KiB: over shared memory
]


def shapes(batches=BATCHES, seq_lens=SEQ_LENS) -> list[dict]:
    return [{"B": b, "N": n, "H": H, "H_kv": H_KV, "D": D, "N_q": N_Q}
            for b in batches for n in seq_lens]


def kv_bytes(shape: dict, bytes_per_el: int = 2) -> int:
    """Bytes of K and V one call must read: 2·B·H_kv·N·D·bytes_per_el."""
    return 2 * shape["B"] * shape["H_kv"] * shape["N"] * shape["D"] * bytes_per_el


def run_sweep(shape_list, providers, measure, copy_gbs: float, progress: bool = True) -> list:
    """``measure(provider, shape) -> dict`` with ``ms`` (None when refused) and maybe ``error``,
    ``max_err``; adds µs, TB/s and the fraction of ``copy_gbs``. A provider that raises is
    recorded with its error and the sweep goes on. (A fake ``measure`` tests this on a CPU.)"""
    def derive(shape, rec):
        ms = rec.get("ms")
        rec["us"] = None if ms is None else ms * 1e3
        for key in ("ms_eager", "ms_eager_default"):
            if rec.get(key) is not None:
                rec["us" + key[2:]] = rec[key] * 1e3
        rec["tbs"] = None if not ms else kv_bytes(shape) / (ms * 1e-3) / 1e12
        rec["copy_fraction"] = None if rec["tbs"] is None else rec["tbs"] * 1e3 / copy_gbs

    return [{**shape, "kv_bytes": kv_bytes(shape), "results": results}
            for shape, results in sweep(shape_list, providers, measure, derive, "decode",
                                        lambda s: f"B={s['B']} N={s['N']}", progress)]


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table(result: dict) -> str:
    """Per provider and shape: latency as a CUDA-graph replay and called eagerly (µs), and the
    graph time's KV bandwidth as a fraction of the copy bandwidth."""
    short = {"flash_decode": "flash", "paged_decode": "paged", "flash_attn_v2": "v2",
             "sdpa-FLASH_ATTENTION": "FA",
             "sdpa-CUDNN_ATTENTION": "cuDNN", "sdpa-MATH": "MATH"}
    rows, cols = [], ["B", "N"]
    for p in result["providers"]:
        s = short.get(p, p)
        cols += [f"{s} graph µs", f"{s} eager µs", f"{s} %copy"]
    for r in result["rows"]:
        row = {"B": r["B"], "N": f"{r['N'] // 1024}k"}
        for p in result["providers"]:
            rec = r["results"].get(p, {})
            s = short.get(p, p)
            row[f"{s} graph µs"] = rec.get("us")
            row[f"{s} eager µs"] = rec.get("us_eager")
            frac = rec.get("copy_fraction")
            row[f"{s} %copy"] = None if frac is None else 100 * frac
        rows.append(row)
    return format_table(rows, cols, floatfmt="{:.1f}")


def _rec(result, B, N, provider):
    for r in result["rows"]:
        if r["B"] == B and r["N"] == N:
            return r["results"].get(provider, {})
    return {}


def targets(result: dict) -> list[dict]:
    """The speed targets (``TARGETS``), measured: what, value, target, met (None: not
    measured)."""
    out = []
    frac = _rec(result, 1, 131072, "flash_decode").get("copy_fraction")
    out.append({"target": "B=1 N=128k flash_decode KV bw / copy bw", "value": frac,
                "bound": f">= {TARGETS['bw_fraction_b1_128k']} "
                         f"(goal {TARGETS['bw_fraction_b1_128k_goal']})",
                "met": None if frac is None else frac >= TARGETS["bw_fraction_b1_128k"]})
    lat = _ratio(_rec(result, 1, 4096, "flash_decode").get("us"),
                 _rec(result, 1, 4096, "sdpa-CUDNN_ATTENTION").get("us"))
    out.append({"target": "B=1 N=4k flash_decode latency / CUDNN_ATTENTION", "value": lat,
                "bound": f"<= {TARGETS['latency_vs_cudnn_b1_4k']}",
                "met": None if lat is None else lat <= TARGETS["latency_vs_cudnn_b1_4k"]})
    for r in result["rows"]:
        pr = _ratio(r["results"].get("paged_decode", {}).get("us"),
                    r["results"].get("flash_decode", {}).get("us"))
        out.append({"target": f"B={r['B']} N={r['N'] // 1024}k paged / flash latency",
                    "value": pr, "bound": f"<= {TARGETS['paged_vs_flash']}",
                    "met": None if pr is None else pr <= TARGETS["paged_vs_flash"]})
    return out


def report(result: dict) -> str:
    env = result.get("environment", {})
    head = (f"decode attention, N_q={N_Q}, H={H}, H_kv={H_KV}, D={D}, fp16; "
            f"{env.get('gpu', env.get('device', '?'))}, torch {env.get('torch', '?')}, "
            f"triton {env.get('triton', '?')}; copy bandwidth {result['copy_gbs']:.0f} GB/s "
            "(read + write); KV TB/s = 2·B·H_kv·N·D·2 bytes / latency")
    harness = result.get("harness", {})
    if harness:
        head += ("\nharness: " + harness.get("timer", "") + "; graph = " + harness.get("ms", "")
                 + "; eager = " + harness.get("ms_eager", ""))
    parts = [head, table(result)]
    fails = [f"B={r['B']} N={r['N']} {p}: {rec['error']}" for r in result["rows"]
             for p, rec in r["results"].items() if rec.get("error")]
    if fails:
        parts.append("not timed:\n  " + "\n  ".join(fails))
    tg = [{"target": t["target"], "value": t["value"], "bound": t["bound"],
           "met": "-" if t["met"] is None else ("yes" if t["met"] else "NO")}
          for t in targets(result)]
    parts.append("targets\n" + format_table(tg, ["target", "value", "bound", "met"],
                                            floatfmt="{:.3f}"))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- GPU side

class GPUMeasure:
    """``measure(provider, shape)`` on a GPU: inputs once per shape, check, then time."""

    def __init__(self, check: bool = True, configs: dict | None = None, warmup_ms: float = 50,
                 rep_ms: float = 300):
        self.check, self.configs = check, configs or {}
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self._key = self._data = self._ref = None

    def _prepare(self, shape):
        from course_lib.kvcache import contiguous_to_pages

        key = (shape["B"], shape["N"])
        if key == self._key:
            return
        self._key = self._data = self._ref = None
        torch.cuda.empty_cache()
        B, N = shape["B"], shape["N"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, N_Q, D, device="cuda", dtype=torch.float16, generator=gen)
        k = torch.randn(B, H_KV, N, D, device="cuda", dtype=torch.float16, generator=gen)
        v = torch.randn(B, H_KV, N, D, device="cuda", dtype=torch.float16, generator=gen)
        lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
        cpu_gen = torch.Generator().manual_seed(1)
        k_pages, table_ = contiguous_to_pages(k, block_size=BLOCK_SIZE, generator=cpu_gen)
        cpu_gen = torch.Generator().manual_seed(1)
        v_pages, _ = contiguous_to_pages(v, block_size=BLOCK_SIZE, generator=cpu_gen)
        self._data = dict(q=q, k=k, v=v, lens=lens, k_pages=k_pages, v_pages=v_pages,
                          table=table_)
        self._key = key

    def _reference(self):
        """fp32 output of batch 0 (the reference of course_lib.reference, one sequence)."""
        if self._ref is None:
            from course_lib.reference import decode_reference

            d = self._data
            self._ref = decode_reference(d["q"][:1].float(), d["k"][:1].float(),
                                         d["v"][:1].float())
        return self._ref

    def fn(self, name: str, shape: dict, layout: str = "rows", validate: bool = False):
        """The callable timed for a provider (inputs bound).

        SDPA takes the GQA problem in one of two ``layout``s: "rows" (the G query heads of a
        group as G query rows of their K/V head, q viewed (B, H_kv, G·N_q, D), no mask) or
        "gqa" (q (B, H, N_q, D) with ``enable_gqa=True``). Backends differ in which they run
        faster, so both are timed and each backend keeps its faster one. ``validate`` is the
        course kernels' argument (True: the host-side checks that read values back).
        """
        import torch.nn.functional as F

        from course_lib.ops import flash_decode, paged_decode, plan_decode

        d = self._data
        cfg = self.configs.get((shape["B"], shape["N"]), {})
        if cfg.get("config") and name in ("flash_decode", "paged_decode"):  # tuned: a plan
            paged = name == "paged_decode"
            k, v = (d["k_pages"], d["v_pages"]) if paged else (d["k"], d["v"])
            table = d["table"] if paged else None
            plan = plan_decode(d["q"], k, v, block_table=table,
                               num_splits=cfg.get("num_splits"), config=cfg["config"])
            return lambda: plan.run(d["q"], k, v, d["lens"], table, validate=validate)
        if name == "flash_decode":
            return lambda: flash_decode(d["q"], d["k"], d["v"], d["lens"], validate=validate,
                                        num_splits=cfg.get("num_splits"))
        if name == "paged_decode":
            return lambda: paged_decode(d["q"], d["k_pages"], d["v_pages"], d["table"],
                                        d["lens"], validate=validate,
                                        num_splits=cfg.get("num_splits"))
        if name == "flash_attn_v2":  # the prefill kernel asked to decode: one program per
            from course_lib.ops import flash_attn_v2  # (query block, head)

            return lambda: flash_attn_v2(d["q"], d["k"], d["v"], causal=True)
        if name.startswith("sdpa-"):
            backend = name[5:]
            B = shape["B"]
            if layout == "rows":
                q_rows = d["q"].view(B, H_KV, (H // H_KV) * N_Q, D)  # GQA group -> query rows

                def run():
                    with sdpa_backend(backend):
                        o = F.scaled_dot_product_attention(q_rows, d["k"], d["v"])
                    return o.view(B, H, N_Q, D)
            elif layout == "gqa":
                def run():
                    with sdpa_backend(backend):
                        return F.scaled_dot_product_attention(d["q"], d["k"], d["v"],
                                                              enable_gqa=True)
            else:
                raise ValueError(f"unknown SDPA layout {layout!r}")
            return run
        raise ValueError(f"unknown provider {name!r}")

    def _time(self, fn, rec: dict) -> dict:
        """Check ``fn`` against the fp32 reference, then time it eagerly and as a graph."""
        if self.check:
            out = fn()[:1].float()
            err = (out - self._reference()).abs().max().item()
            rec["max_err"] = float("inf") if math.isnan(err) else err
            if not rec["max_err"] <= 1e-2:  # fp16 output of values ~N(0, 1): ~1e-3 expected
                return {**rec, "ms": None, "ms_eager": None,
                        "error": f"wrong output: max err {err:.2e}"}
        else:
            fn()
        torch.cuda.synchronize()
        rec["ms_eager"] = median_ms(fn, warmup_ms=self.warmup_ms, rep_ms=self.rep_ms)
        try:
            rec["ms"] = graph_median_ms(fn, warmup_ms=self.warmup_ms, rep_ms=self.rep_ms)
        except Exception as exc:  # a provider that cannot be captured has no graph time
            rec["ms"], rec["graph_error"] = None, describe_error(exc)
        return rec

    def __call__(self, name: str, shape: dict) -> dict:
        """One provider at one shape, timed both ways (the JSON's ``harness`` says how).

        ``ms``: median of CUDA-graph replays (the GPU's time, as a serving loop runs a decode
        step); ``ms_eager``: median of plain calls, Python and launch overhead included. The
        course's kernels are validated once and timed with ``validate=False``;
        ``ms_eager_default`` times them with ``validate=True`` (the checks that read lengths
        and block ids back to the host). SDPA backends are timed in
        both layouts (``fn``) and keep the faster per harness (``layout``, ``layout_eager``).
        """
        self._prepare(shape)
        if name.startswith("sdpa-"):
            layouts = {}
            for layout in SDPA_LAYOUTS:
                try:
                    layouts[layout] = self._time(self.fn(name, shape, layout), {})
                except Exception as exc:  # a backend that refuses one layout
                    layouts[layout] = {"ms": None, "ms_eager": None,
                                       "error": describe_error(exc)}
            rec = {"layouts": layouts}
            for key, which in (("ms", "layout"), ("ms_eager", "layout_eager")):
                timed = {k: r[key] for k, r in layouts.items() if r.get(key) is not None}
                best = min(timed, key=timed.get) if timed else None
                rec[key], rec[which] = (timed[best], best) if best else (None, None)
            rec["max_err"] = max((r["max_err"] for r in layouts.values() if "max_err" in r),
                                 default=None)
            if rec["ms"] is None and rec["ms_eager"] is None:
                rec["error"] = "; ".join(f"{k}: {r.get('error')}" for k, r in layouts.items())
            return rec
        rec = self._time(self.fn(name, shape), {})
        if rec.get("ms_eager") is not None and name != "flash_attn_v2":
            rec["ms_eager_default"] = median_ms(self.fn(name, shape, validate=True),
                                                warmup_ms=self.warmup_ms, rep_ms=self.rep_ms)
        return rec


def tune(measure: GPUMeasure, shape_list, progress: bool = True) -> dict:
    """Time a planned decode step for every TUNE_CONFIGS × a few split counts; the best per
    shape."""
    from tqdm.auto import tqdm

    from course_lib.kernels.decode import choose_num_splits
    from course_lib.ops import plan_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best, trials = {}, []
    for shape in shape_list:
        measure._prepare(shape)
        d = measure._data
        splits = sorted({max(1, s) for s in (
            choose_num_splits(shape["B"], H_KV, shape["N"], 64, sm_count=sms),
            math.ceil(sms / (shape["B"] * H_KV)), math.ceil(2 * sms / (shape["B"] * H_KV)),
            math.ceil(8 * sms / (shape["B"] * H_KV)))})
        splits = [min(s, 256) for s in splits]
        for cfg in tqdm(TUNE_CONFIGS, disable=not progress,
                        desc=f"tune B={shape['B']} N={shape['N']}"):
            for s in splits:
                try:
                    plan = plan_decode(d["q"], d["k"], d["v"], num_splits=s, config=cfg)
                    ms = median_ms(lambda: plan.run(d["q"], d["k"], d["v"], d["lens"],
                                                    validate=False),
                                   warmup_ms=25, rep_ms=100)
                except Exception as exc:  # a config that does not compile is skipped
                    trials.append({**cfg, "num_splits": s, "B": shape["B"], "N": shape["N"],
                                   "error": describe_error(exc)})
                    continue
                trials.append({**cfg, "num_splits": s, "B": shape["B"], "N": shape["N"],
                               "us": ms * 1e3})
                key = (shape["B"], shape["N"])
                if key not in best or ms < best[key]["ms"]:
                    best[key] = {"ms": ms, "config": dict(cfg), "num_splits": s}
    return {"best": best, "trials": trials}


# ----------------------------------------------------------------------------- figure

def plot_decode(result: dict):
    """Fraction of the copy bandwidth per provider, one panel per batch size."""
    from matplotlib.figure import Figure

    batches = sorted({r["B"] for r in result["rows"]})
    fig = Figure(figsize=(5.5 * len(batches), 4.2), layout="constrained")
    axes = fig.subplots(1, len(batches), squeeze=False)[0]
    providers = result["providers"]
    width = 0.8 / len(providers)
    for ax, b in zip(axes, batches):
        rows = sorted((r for r in result["rows"] if r["B"] == b), key=lambda r: r["N"])
        for i, p in enumerate(providers):
            vals = [r["results"].get(p, {}).get("copy_fraction") for r in rows]
            xs = [j + (i - len(providers) / 2 + 0.5) * width for j in range(len(rows))]
            ax.bar(xs, [0 if v is None else 100 * v for v in vals], width=width, label=p)
        ax.axhline(100, color="k", lw=1, ls="--")
        ax.axhline(85, color="tab:red", lw=1, ls=":", label="85% target")
        ax.set_xticks(range(len(rows)), [f"{r['N'] // 1024}k" for r in rows])
        ax.set(xlabel="cached tokens N", ylabel="KV bandwidth, % of copy bandwidth",
               title=f"B = {b}")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    env = result.get("environment", {})
    fig.suptitle(f"decode, N_q = 1, H = {H}, H_kv = {H_KV}, D = {D}, fp16 on "
                 f"{env.get('gpu', '?')} (copy: {result['copy_gbs']:.0f} GB/s)\n"
                 "every provider timed as a CUDA-graph replay (do_bench median)")
    return fig


def _stored_figure():
    result = load_result("decode")
    return None if result is None else plot_decode(result)


#: Figures of this module: image name -> function returning a Figure (None: never measured).
FIGURES = {"12_decode_bandwidth": _stored_figure}


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench decode",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B = 1 only")
    ap.add_argument("--tune", action="store_true",
                    help="sweep the decode configs and split counts first, then use the best")
    ap.add_argument("--providers", default=",".join(PROVIDERS),
                    help="comma-separated subset of " + ",".join(PROVIDERS))
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="where the JSON and PNG go")
    ap.add_argument("--no-check", action="store_true", help="skip the numerics check")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    require_gpu("python -m course_lib.bench decode")
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; choose from {PROVIDERS}")
    shape_list = shapes(batches=(1,) if args.quick else BATCHES)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    measure = GPUMeasure(check=not args.no_check)
    tuned = None
    if args.tune:
        tune_shapes = [s for s in shape_list if (s["B"], s["N"]) in
                       ((1, 4096), (1, 131072), (8, 32768))]
        tuned = tune(measure, tune_shapes)
        for (b, n), rec in tuned["best"].items():
            print(f"tuned B={b} N={n}: {rec['ms'] * 1e3:.1f} µs with {rec['config']}, "
                  f"num_splits={rec['num_splits']}")
        measure.configs = {key: rec for key, rec in tuned["best"].items()}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_tune.json").write_text(json.dumps(
            {"best": [{"B": b, "N": n, **{k: v for k, v in rec.items()}}
                      for (b, n), rec in tuned["best"].items()],
             "trials": tuned["trials"]}, indent=1) + "\n")
    rows = run_sweep(shape_list, providers, measure, copy_gbs)
    from course_lib.kernels.decode import DECODE_CONFIGS, PROGRAMS_PER_SM

    result = {"subject": "decode", "providers": providers, "copy_gbs": copy_gbs,
              "shape": {"N_q": N_Q, "H": H, "H_kv": H_KV, "D": D, "dtype": "fp16",
                        "block_size": BLOCK_SIZE},
              "harness": HARNESS,
              "kv_bytes_formula": "2·B·H_kv·N·D·2", "flops_formula": "4·B·H·N_q·N·D",
              "flash_decode_config": {"default": DECODE_CONFIGS[D],
                                      "programs_per_sm": PROGRAMS_PER_SM,
                                      "tuned": None if tuned is None else
                                      [{"B": b, "N": n, **rec}
                                       for (b, n), rec in tuned["best"].items()]},
              "rows": rows}
    path = save_result("decode", result, args.out)
    if not args.no_plot:
        fig = plot_decode(json.loads(path.read_text()))
        fig.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight")
    print(f"\nsaved {path}\n")
    print(report(json.loads(path.read_text())))
    return 0
