"""python -m course_lib.bench hbm: DRAM bytes read and written, measured by Nsight Compute.

Introduced in notebooks/07_triton_flash_v1.ipynb; used again in notebooks/08_triton_flash_v2.ipynb.

At the FlashAttention paper's Figure 2 shape (B 64, H 16, N 1024, d 64, fp16, forward,
non-causal) each implementation runs once inside a profiled range of its own process::

    ncu --clock-control none --profile-from-start off \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv \\
        python -m course_lib.bench hbm --target NAME

and the bytes of every kernel in the range are summed (SDPA MATH runs several kernels). The
table puts them next to the course's IO model (``course_lib.iomodel.attention.figure2_prediction``):

* the minimum: Q, K, V read once, O and lse written once (v2 and SDPA's fused backends should
  come close: v2 within 1.05×; the K/V re-reads of v2's Q blocks hit L2);
* standard attention (SDPA MATH): S and P written to and read back from HBM, Θ(Nd + N²),
  counted in fp16. PyTorch's MATH backend moves more (an H100 run measured 4.6× the count): it
  upcasts fp16 inputs to fp32 (fp32 GEMMs and softmax, 17 kernels with copies and masks);
* v1: ``flash_v1_io(..., kernel_bookkeeping=True)`` with the kernel's GPU block sizes: O, l, m
  are read and written back at every one of the N/BLOCK_N steps. That is the point of the table.

    python -m course_lib.bench hbm [--ncu PATH] [--targets v1,v2-portable,...] [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from course_lib.bench.common import DATA_DIR, format_table, require_gpu, save_result

FIGURE2 = {"B": 64, "H": 16, "N": 1024, "D": 64, "dtype": "fp16", "causal": False}
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
SDPA_TARGETS = ("sdpa-MATH", "sdpa-FLASH_ATTENTION", "sdpa-CUDNN_ATTENTION")
NCU_PLACES = ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu")
ROOT = Path(__file__).resolve().parents[2]
_UNITS = {"byte": 1, "bytes": 1, "b": 1, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6,
          "gbyte": 1e9, "gb": 1e9, "tbyte": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def targets(impls=()) -> list[str]:
    return [*SDPA_TARGETS, "v1", *(f"v2-{impl}" for impl in impls)]


# ----------------------------------------------------------------------------- predictions

_BASIS = {"standard": "standard attention: S and P through HBM (iomodel standard)",
          "flash_v1_kernel": "v1 as the kernel runs it (iomodel flash_v1_io, kernel_bookkeeping)",
          "flash_v2_min": "minimum: Q, K, V read once, O and lse written once"}


def predictions(impls=()) -> dict:
    """The IO model's Figure 2 prediction (bytes) and, per target, (predicted bytes, basis)."""
    from course_lib.iomodel.attention import figure2_prediction
    from course_lib.kernels.flash_v1 import block_sizes

    blocks = block_sizes(FIGURE2["D"], on_gpu=True)[:2]  # what flash_attn_v1 uses on a GPU
    model = figure2_prediction(v1_blocks=blocks)
    which = {"sdpa-MATH": "standard", "sdpa-FLASH_ATTENTION": "flash_v2_min",
             "sdpa-CUDNN_ATTENTION": "flash_v2_min", "v1": "flash_v1_kernel",
             **{f"v2-{impl}": "flash_v2_min" for impl in impls}}
    per_target = {t: (model[key], _BASIS[key] + (f", BLOCK_M={blocks[0]} BLOCK_N={blocks[1]}"
                                                 if t == "v1" else ""))
                  for t, key in which.items()}
    return {"model": model, "targets": per_target, "minimum": model["flash_v2_min"]}


# ----------------------------------------------------------------------------- Nsight Compute


def find_ncu(explicit: str | None = None) -> str | None:
    """The ncu to use: ``explicit``, else ncu on PATH, else the usual install places."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in NCU_PLACES:
        hits = sorted(glob.glob(pattern))
        if hits and os.access(hits[-1], os.X_OK):
            return hits[-1]
    return None


def ncu_command(ncu: str, target: str) -> list[str]:
    return [ncu, "--clock-control", "none", "--profile-from-start", "off",
            "--metrics", ",".join(METRICS), "--csv",
            sys.executable, "-m", "course_lib.bench", "hbm", "--target", target]


def parse_ncu_csv(text: str) -> dict:
    """Sum ncu's ``--csv`` metric rows over every kernel: bytes read, bytes written, kernels."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no metric table in ncu's output (no kernel was profiled?)")
    body = [ln for ln in lines[start:] if ln.startswith('"')]
    total = {"read": 0.0, "write": 0.0}
    kernels = {}
    for row in csv.DictReader(io.StringIO("\n".join(body))):
        metric = row.get("Metric Name", "")
        if metric not in METRICS:
            continue
        unit = row.get("Metric Unit", "byte").strip().lower()
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {unit!r} for {metric}")
        value = float(row["Metric Value"].replace(",", "")) * _UNITS[unit]
        total["read" if metric == METRICS[0] else "write"] += value
        kernels[row["ID"]] = row.get("Kernel Name", "?")
    if not kernels:
        raise ValueError("ncu printed a table without DRAM metrics")
    return {"read": total["read"], "write": total["write"], "kernels": len(kernels),
            "kernel_names": sorted(set(kernels.values()))}


def measure(ncu: str, target: str, timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(ncu_command(ncu, target), capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)
    try:
        got = parse_ncu_csv(proc.stdout)
    except ValueError as exc:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"{exc}; ncu exit {proc.returncode}; last output:\n{tail}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"ncu exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return got


# ----------------------------------------------------------------------------- target mode


def _impl(target: str, causal: bool):
    from course_lib.bench.attention import provider_fn

    return provider_fn(target, causal)


def run_target(target: str, shape: dict = FIGURE2) -> None:
    """Inside ncu: fresh inputs, two warm-up runs, then one run in the profiled range."""
    import torch.cuda.profiler as profiler

    fn = _impl(target, shape["causal"])
    q, k, v = (torch.randn(shape["B"], shape["H"], shape["N"], shape["D"], device="cuda",
                           dtype=torch.float16) for _ in range(3))
    for _ in range(2):  # compile, pick algorithms, allocate
        fn(q, k, v)
    torch.cuda.synchronize()
    profiler.start()
    fn(q, k, v)
    torch.cuda.synchronize()
    profiler.stop()


# ----------------------------------------------------------------------------- the table


def make_rows(measured: dict, preds: dict, minimum: float) -> list[dict]:
    """Table rows from ``measured[target]`` (parse_ncu_csv's dict, or {"error": ...}) and
    ``preds[target]`` = (predicted bytes, basis)."""
    rows = []
    for target, got in measured.items():
        pred, basis = preds.get(target, (None, None))
        row = {"target": target, "predicted_gb": None if pred is None else pred / 1e9,
               "prediction": basis, "read_gb": None, "write_gb": None, "total_gb": None,
               "kernels": None, "measured/predicted": None, "x minimum": None,
               "error": got.get("error")}
        if got.get("error") is None:
            total = got["read"] + got["write"]
            row.update(read_gb=got["read"] / 1e9, write_gb=got["write"] / 1e9,
                       total_gb=total / 1e9, kernels=got["kernels"],
                       kernel_names=got["kernel_names"], **{"x minimum": total / minimum})
            if pred:
                row["measured/predicted"] = total / pred
        rows.append(row)
    return rows


def report(result: dict) -> str:
    env, s = result.get("environment", {}), result["shape"]
    head = (f"DRAM bytes (Nsight Compute dram__bytes_read.sum + dram__bytes_write.sum), "
            f"B={s['B']} H={s['H']} N={s['N']} d={s['D']} {s['dtype']} forward; "
            f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
            f"triton {env.get('triton', '?')}; minimum {result['minimum_gb']:.3f} GB")
    cols = ["target", "kernels", "read_gb", "write_gb", "total_gb", "predicted_gb",
            "measured/predicted", "x minimum"]
    parts = [head, format_table(result["rows"], cols, floatfmt="{:.3f}")]
    notes = [f"  {r['target']}: {r['prediction']}" for r in result["rows"] if r["prediction"]]
    parts.append("predictions (course_lib.iomodel.attention.figure2_prediction):\n"
                 + "\n".join(notes))
    model = result.get("iomodel_bytes") or {}
    if model:
        parts.append("IO model, GB: " + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in model.items())
                     + "\n  (flash_v2 counts every K/V re-read of v2's Q blocks; flash_v2_min "
                       "assumes L2 serves them)")
    errs = [f"  {r['target']}: {r['error']}" for r in result["rows"] if r["error"]]
    if errs:
        parts.append("not measured:\n" + "\n".join(errs))
    v2 = [r for r in result["rows"] if r["target"].startswith("v2-") and r["x minimum"]]
    if v2:
        parts.append("v2 against the minimum (goal ≤ 1.05×): " + ", ".join(
            f"{r['target']} {r['x minimum']:.3f}×" for r in v2))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench hbm",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--ncu", default=None, help="path of Nsight Compute's ncu")
    ap.add_argument("--targets", default=None, help="comma-separated subset of the targets")
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)  # run inside ncu
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    require_gpu("python -m course_lib.bench hbm")
    if args.target:
        run_target(args.target)
        return 0

    from course_lib.bench.attention import _v2_impls

    ncu = find_ncu(args.ncu)
    if ncu is None:
        raise SystemExit(
            "Nsight Compute's ncu was not found" + (f" at {args.ncu}" if args.ncu else
                                                   " on PATH, in /usr/local/cuda/bin or in "
                                                   "/opt/nvidia/nsight-compute/*/") +
            ". Install Nsight Compute or pass --ncu PATH. Stored results: course_lib/data/hbm.json")
    impls, why = _v2_impls()
    if why:
        print(f"note: no v2 targets ({why})")
    names = targets(impls)
    if args.targets:
        wanted = [t for t in args.targets.split(",") if t]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"unknown targets {unknown}; this run knows {names}")
        names = [t for t in names if t in wanted]
    from tqdm.auto import tqdm

    measured = {}
    for target in tqdm(names, desc="ncu", unit="target"):
        try:
            measured[target] = measure(ncu, target)
        except Exception as exc:
            measured[target] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    pred = predictions(impls)
    payload = {"subject": "hbm", "shape": FIGURE2, "ncu": ncu, "metrics": list(METRICS),
               "minimum_gb": pred["minimum"] / 1e9, "iomodel_bytes": pred["model"],
               "rows": make_rows(measured, pred["targets"], pred["minimum"])}
    path = save_result("hbm", payload, args.out)
    if not args.no_plot:
        from course_lib.bench.plots import plot_hbm, save_figure

        save_figure(plot_hbm(json.loads(path.read_text())), path.with_suffix(".png"))
    print(f"wrote {path}")
    print(report(json.loads(path.read_text())))
    return 0
