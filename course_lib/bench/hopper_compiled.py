"""python -m course_lib.bench.hopper_compiled: what the compiler made of the Hopper kernel.

Introduced in notebooks/09_hopper.ipynb (sections 2 and 3). The lesson's GPU-only outputs,
computed on a GPU and stored in ``course_lib/data/hopper_compiled.json`` (with the environment
that produced them), so that a reader without a GPU sees them too; on a GPU the notebook
computes them afresh with the same functions:

* ``sass_rows``: SASS instruction counts (``OPCODES``: HGMMA, HMMA, UTMALDG, LDGSTS, MUFU.EX2) of
  the portable and the Hopper kernel compiled with the same config, with each one's shared
  memory, registers and spills;
* ``q_form_rows``: one config compiled with Q in shared memory and with Q in registers;
* ``config_rows``: every candidate of ``bench.kernel_configs.HOPPER_CONFIGS`` at D 64, 128, 256
  (N 4096, non-causal, fp16, B·N = 32k, H·D = 2048): the compiler's shared memory next to the
  estimate of ``analysis.hopper.smem_bytes``, registers, spills, the error against the fp32
  reference (2x rule), and single timings in interleaved rounds (each round times every config
  once; TFLOP/s with FLOPs = 4·B·H·N²·D). A config that does not compile or does not fit is
  recorded with its error.

    python -m course_lib.bench.hopper_compiled [--rounds 3] [--head-dims 64,128,256] [--out DIR]

Writes ``hopper_compiled.json`` (default: course_lib/data).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from course_lib.bench.common import (
    DATA_DIR,
    describe_error,
    format_table,
    load_result,
    median_ms,
    require_gpu,
    save_result,
)

NAME = "hopper_compiled"
OPCODES = ("HGMMA", "HMMA", "UTMALDG", "LDGSTS", "MUFU.EX2")
SASS_CONFIG = ("128x64 w4 s3", 128)  # (config label, head dim) of the instruction counts
Q_FORM_CONFIG = ((128, 64, 4, 3), 64)  # (BLOCK_M, BLOCK_N, warps, stages), head dim
MISSING = ("The GPU numbers are not stored yet: course_lib/data/hopper_compiled.json appears "
           "after a GPU run of `python -m course_lib.bench.hopper_compiled`.")


def _compiled_facts(compiled) -> dict:
    """Shared memory (KiB), registers per thread and spilled registers of a compiled kernel."""
    return {"smem_kib": compiled.metadata.shared / 1024, "regs": compiled.n_regs,
            "spills": compiled.n_spills}


def _sass_counts(compiled) -> dict:
    """``OPCODES`` counted in the kernel's SASS (static: lines of the listing), or the reason
    there is no SASS (Triton disassembles the cubin with cuobjdump)."""
    from course_lib.bench.kernel_configs import count_instructions

    try:
        sass = compiled.asm["sass"]
    except Exception as exc:  # no cuobjdump: keep the rest of the row
        return {op: None for op in OPCODES} | {"sass_error": describe_error(exc)}
    return {op: count_instructions(sass, op) for op in OPCODES} | {"sass_error": None}


def _inputs(D: int, N: int = 4096, tokens: int = 32768, hidden: int = 2048):
    """((B, H, N, D), [q, k, v]) in fp16 with B·N = ``tokens`` and H·D = ``hidden``."""
    import torch

    from course_lib.testing import fresh_randn

    B, H = max(1, tokens // N), max(1, hidden // D)
    return (B, H, N, D), [fresh_randn(B, H, N, D, dtype=torch.float16, seed=s)
                          for s in range(3)]


def sass_rows(label: str = SASS_CONFIG[0], D: int = SASS_CONFIG[1]) -> list[dict]:
    """Both kernels compiled with the Hopper config ``label`` (the portable kernel ignores the
    Hopper-only switches) at head dim ``D``: instruction counts, shared memory, registers."""
    from course_lib.bench.kernel_configs import HOPPER_CONFIGS, config_label, launch_config

    cfg = next(c for c in HOPPER_CONFIGS if config_label(c) == label)
    _, (q, k, v) = _inputs(D, tokens=4096, hidden=16 * D)  # (1, 16, 4096, D)
    rows = []
    for impl in ("portable", "hopper"):
        _, _, compiled = launch_config(impl, q, k, v, False, cfg)
        rows.append({"kernel": impl, "config": label, "D": D, **_sass_counts(compiled),
                     **_compiled_facts(compiled)})
    return rows


def q_form_rows(shape4: tuple = Q_FORM_CONFIG[0], D: int = Q_FORM_CONFIG[1]) -> list[dict]:
    """One config of the Hopper kernel with Q in shared memory and with Q in registers."""
    from course_lib.bench.kernel_configs import config_label, launch_config, smem_bytes
    from course_lib.kernels import flash_v2_hopper as hop

    _, (q, k, v) = _inputs(D, tokens=4096, hidden=16 * D)  # (1, 16, 4096, D)
    rows = []
    for regs in (False, True):
        cfg = hop._cfg(*shape4, regs)
        _, _, compiled = launch_config("hopper", q, k, v, False, cfg)
        est = smem_bytes(shape4[0], shape4[1], D, shape4[3], q_in_regs=regs)
        rows.append({"config": config_label(cfg), "D": D, "Q": "registers" if regs else "smem",
                     "estimate_kib": est["total"] / 1024, **_compiled_facts(compiled)})
    return rows


def config_rows(head_dims=(64, 128, 256), rounds: int = 3, N: int = 4096,
                warmup_ms: float = 25, rep_ms: float = 100, progress: bool = True) -> list[dict]:
    """Every candidate config at each head dim: compiled resources, error, single timings.

    Each config is first launched once (compile, resources, error against the fp32 reference on
    batch 0, head 0, with the 2x rule against fp16 PyTorch); then ``rounds`` rounds each time
    every config that ran once (A B C ..., A B C ...), so that clock drift spreads over all.
    """
    import torch

    from course_lib.bench.kernel_configs import (
        HOPPER_CONFIGS,
        config_label,
        kept,
        launch_config,
        smem_bytes,
    )
    from course_lib.reference import attention, attention_flops
    from course_lib.testing import attention_same_precision

    rows = []
    for D in head_dims:
        (B, H, _, _), qkv = _inputs(D, N)
        q, k, v = qkv
        flops = attention_flops(B, H, N, N, D)
        one = (q[:1, :1], k[:1, :1], v[:1, :1])
        ref = attention(*one)
        torch_err = (attention_same_precision(*one).float() - ref).abs().max().item()
        ran = []
        for cfg in HOPPER_CONFIGS:
            kw = cfg.kwargs
            est = smem_bytes(kw["BLOCK_M"], kw["BLOCK_N"], D, cfg.num_stages,
                             q_in_regs=kw["Q_IN_REGS"])
            row = {"D": D, "N": N, "B": B, "H": H, "config": config_label(cfg),
                   "kept": kept(cfg, D), "estimate_kib": est["total"] / 1024,
                   "torch_err": torch_err, "error": None}
            try:
                o, _, compiled = launch_config("hopper", q, k, v, False, cfg)
                err = (o[:1, :1].float() - ref).abs().max().item()
                row |= _compiled_facts(compiled) | {"max_err": err,
                                                    "2x rule": err <= 2 * torch_err + 1e-3,
                                                    "ms_rounds": []}
                ran.append((cfg, row))
            except Exception as exc:  # does not compile, or does not fit
                row["error"] = describe_error(exc)
            rows.append(row)
            if progress:
                print(f"D {D} {row['config']}: {row['error'] or 'compiled'}", flush=True)
        for _ in range(rounds):
            for cfg, row in ran:
                row["ms_rounds"].append(median_ms(
                    lambda cfg=cfg: launch_config("hopper", *qkv, False, cfg),
                    warmup_ms=warmup_ms, rep_ms=rep_ms))
        for _, row in ran:
            ms = statistics.median(row["ms_rounds"])
            row |= {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                    "spread": max(row["ms_rounds"]) / min(row["ms_rounds"]) - 1}
        qkv.clear()  # free this head dim's inputs before the next
        q = k = v = o = None
        torch.cuda.empty_cache()
    return rows


def measure(head_dims=(64, 128, 256), rounds: int = 3, progress: bool = True) -> dict:
    """Everything this module stores: instruction counts, the two forms of Q, every config."""
    return {"subject": "Hopper kernel as compiled: SASS, shared memory, registers, timings",
            "dtype": "fp16", "opcodes": list(OPCODES), "rounds": rounds,
            "flops_formula": "4·B·H·N_q·N_k·D", "sass": sass_rows(), "q_forms": q_form_rows(),
            "configs": config_rows(head_dims, rounds, progress=progress)}


def load() -> dict | None:
    """The stored result, or None (then print ``MISSING``)."""
    return load_result(NAME)


def environment_line(result: dict) -> str:
    env = result.get("environment", {})
    return (f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}, triton "
            f"{env.get('triton', '?')}, {env.get('date', '?')}")


HEADERS = {"smem_kib": "smem KiB", "estimate_kib": "estimate KiB", "tflops": "TFLOP/s"}


def _table(rows: list[dict], columns: list[str]) -> str:
    """``format_table`` with readable headers for the stored keys (``HEADERS``)."""
    shown = [{HEADERS.get(k, k): v for k, v in r.items()} for r in rows]
    return format_table(shown, [HEADERS.get(c, c) for c in columns], floatfmt="{:.1f}")


def sass_table(rows: list[dict]) -> str:
    """Instruction counts per kernel, with shared memory (KiB), registers and spills."""
    out = _table(rows, ["kernel", "config", "D", *OPCODES, "smem_kib", "regs", "spills"])
    why = {r["sass_error"] for r in rows if r.get("sass_error")}
    return out + "".join(f"\nno SASS: {w}" for w in why)


def q_form_table(rows: list[dict]) -> str:
    """Shared memory (estimate and compiled), registers and spills of the two forms of Q."""
    return _table(rows, ["config", "D", "Q", "estimate_kib", "smem_kib", "regs", "spills"])


COLUMNS = {
    "resources": ["D", "config", "kept", "estimate_kib", "smem_kib", "regs", "spills", "2x rule"],
    "timings": ["D", "config", "kept", "tflops", "spread %", "rounds"],
}


def config_table(rows: list[dict], D: int | None = None, columns: str | None = None) -> str:
    """Per config: estimated and compiled shared memory, registers, spills and the 2x rule
    (``columns="resources"``), or TFLOP/s (median of the rounds), the spread of the single
    timings (max / min - 1) and the number of rounds (``"timings"``); both when None. Configs
    that did not run are listed with their reason."""
    sel = [r for r in rows if D is None or r["D"] == D]
    shown = [{**r, "kept": "kept" if r["kept"] else "", "rounds": len(r.get("ms_rounds", [])),
              "spread %": 100 * r["spread"] if r.get("spread") is not None else None}
             for r in sel if not r["error"]]
    cols = (COLUMNS[columns] if columns else
            list(dict.fromkeys(COLUMNS["resources"] + COLUMNS["timings"])))
    out = _table(shown, cols)
    failed = [f"  D {r['D']} {r['config']}: {r['error'][:90]}" for r in sel
              if r["error"] and columns != "timings"]
    return out + ("\nnot run (does not compile or fit):\n" + "\n".join(failed) if failed else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench.hopper_compiled",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    args = ap.parse_args(argv)
    require_gpu("python -m course_lib.bench.hopper_compiled")
    result = measure(tuple(int(d) for d in args.head_dims.split(",")), args.rounds)
    path = save_result(NAME, result, args.out)
    print(f"wrote {path}")
    print(sass_table(result["sass"]))
    print(q_form_table(result["q_forms"]))
    print(config_table(result["configs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
