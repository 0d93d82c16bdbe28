"""python -m course_lib.bench hopper: what holding Q in registers buys the Hopper kernel.

Introduced in notebooks/09_hopper.ipynb, section 3. ``flash_v2_hopper`` can feed the QKᵀ
``wgmma`` its A operand (Q) from shared memory or from registers (``Q_IN_REGS``). This command
times each pair of otherwise identical fixed configs, with SDPA's FLASH_ATTENTION and
CUDNN_ATTENTION backends, at the shapes of the FlashAttention-2 paper's benchmark (Dao 2023,
Section 4.1) with B·N = 32k tokens where the paper keeps 16k (H·D = 2048, fp16).
Every provider of a shape is timed in turn, ``--rounds`` times over (A B C, A B C, ...), and
keeps its median: the GPU's clock drifts by several per cent within seconds, and interleaving
spreads the drift over every provider alike. Each config's output is first checked against the
fp32 reference (at most twice SDPA FLASH_ATTENTION's error), as in ``bench attention``.

    python -m course_lib.bench hopper [--rounds 5] [--seq-lens 4096,16384] [--out DIR]

Writes ``hopper_q_in_regs.json`` (default: course_lib/data).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from course_lib.bench import attention
from course_lib.bench.common import (
    DATA_DIR,
    format_table,
    require_gpu,
    save_result,
    sweep,
)

NAME = "hopper_q_in_regs"
# (BLOCK_M, BLOCK_N, warps, stages) per head dim: each is timed with Q in registers and without
PAIRS = {64: [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3)],
         128: [(128, 128, 8, 2), (128, 128, 8, 3)]}
SDPA = ("sdpa-FLASH_ATTENTION", "sdpa-CUDNN_ATTENTION")


def config(shape4: tuple, q_in_regs: bool):
    """The ``triton.Config`` of a (BLOCK_M, BLOCK_N, warps, stages) tuple."""
    from course_lib.kernels.flash_v2_hopper import _cfg

    return _cfg(*shape4, q_in_regs)


def providers(D: int) -> list[str]:
    """Provider names of one head dim: the SDPA backends, then each config in both forms."""
    from course_lib.bench.kernel_configs import config_label

    return [*SDPA, *(config_label(config(c, regs)) for c in PAIRS[D] for regs in (False, True))]


def shapes(head_dims=(64, 128), seq_lens=(4096, 16384), causal=(False, True)) -> list[dict]:
    """The attention sweep's shapes (``bench.attention.shapes``) at these head dims and lengths."""
    return attention.shapes(head_dims, seq_lens, causal=causal)


def gain_rows(result: dict) -> list[dict]:
    """Per shape and config: TFLOP/s with Q in shared memory, in registers, and their ratio."""
    rows = []
    for row in result["rows"]:
        res = row["results"]
        fa2 = res["sdpa-FLASH_ATTENTION"]["tflops"]
        for name, rec in res.items():
            if not name.endswith(" Q smem"):
                continue
            regs = res[name[: -len(" Q smem")]]
            gain = (regs["tflops"] / rec["tflops"]
                    if regs.get("tflops") and rec.get("tflops") else None)
            rows.append({"D": row["D"], "causal": row["causal"], "N": row["N"],
                         "config": name[: -len(" Q smem")], "Q smem": rec.get("tflops"),
                         "Q regs": regs.get("tflops"), "regs/smem": gain,
                         "regs/FA2": regs["tflops"] / fa2 if regs.get("tflops") and fa2 else None})
    return rows


def run(shape_list: list[dict], measure, rounds: int = 5, progress: bool = True) -> dict:
    """Sweep every shape with its head dim's providers; ``measure(name, shape) -> {"ms": ...}``."""
    rows = []
    for D in sorted({s["D"] for s in shape_list}):
        names = providers(D)

        def derive(shape, rec):
            rec["tflops"] = attention.tflops(attention.shape_flops(shape, "fwd"), rec.get("ms"))

        out = sweep([s for s in shape_list if s["D"] == D], names, measure, derive,
                    f"hopper D={D}", lambda s: f"N={s['N']} causal={s['causal']}", progress,
                    rounds)
        rows += [{**shape, "results": res} for shape, res in out]
    return {"subject": "hopper Q in registers", "rounds": rounds, "dtype": "fp16",
            "pairs": {str(d): [list(c) for c in cs] for d, cs in PAIRS.items()}, "rows": rows}


def provider_fn(name: str, causal: bool):
    """The callable ``(q, k, v) -> o`` behind a provider name: an SDPA backend or a config."""
    if name in SDPA:
        return attention.provider_fn(name, causal)
    from course_lib.bench.kernel_configs import config_label, launch_config

    cfg = next((config(c, r) for pairs in PAIRS.values() for c in pairs for r in (False, True)
                if config_label(config(c, r)) == name), None)
    if cfg is None:
        raise ValueError(f"unknown provider {name!r}")
    return lambda q, k, v: launch_config("hopper", q, k, v, causal, cfg)[0]


def gpu_measure(warmup_ms: float = 25, rep_ms: float = 100):
    """The attention sweep's ``GPUMeasure`` (inputs once per shape; each config checked once
    against the fp32 reference with the 2x rule, then timed) over this command's providers."""
    import torch

    return attention.GPUMeasure("fwd", torch.float16, warmup_ms, rep_ms, provider=provider_fn)


def report(result: dict) -> str:
    env = result.get("environment", {})
    head = (f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, triton "
            f"{env.get('triton', '?')}; median of {result['rounds']} interleaved rounds, TFLOP/s")
    return head + "\n" + format_table(gain_rows(result), ["D", "causal", "N", "config", "Q smem",
                                                          "Q regs", "regs/smem", "regs/FA2"],
                                      floatfmt="{:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench hopper",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq-lens", default="4096,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    args = ap.parse_args(argv)
    require_gpu("python -m course_lib.bench hopper")
    shape_list = shapes([int(d) for d in args.head_dims.split(",")],
                        [int(n) for n in args.seq_lens.split(",")])
    result = run(shape_list, gpu_measure(), rounds=args.rounds)
    path = save_result(NAME, result, args.out)
    import json

    print(f"wrote {path}")
    print(report(json.loads(path.read_text())))
    return 0
