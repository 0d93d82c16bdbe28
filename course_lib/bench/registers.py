"""Registers, spills and shared memory of the backward's dK/dV kernel, compiled for a Hopper GPU
on any machine: no GPU needed.

    python -m course_lib.bench registers [--out FILE]

Triton's wheel carries NVIDIA's ``ptxas`` and ``cuobjdump``: ``triton.compile`` builds the
kernel's cubin for a target named by hand (sm_90, the H100 and H200), and
``cuobjdump -res-usage`` reads what ptxas gave each thread: its registers (at most 255) and its
stack, the local memory where the values that did not fit were spilled. The kernel is compiled
at every dK/dV tile the autotuner may pick (``flash_bwd.DKDV_CONFIGS``, with their warps and
stages), D 64 and 128, causal and not, in the two-kernel form and the one pass, with the
pointer alignment (16 bytes) Triton assumes on a GPU for tensors from PyTorch. What ptxas does
depends on the Triton version; the stored run names it.

The kernels must be compiled, not interpreted: on a machine without a GPU the course runs them
in Triton's interpreter, so the work is done in a child process that tells ``course_lib`` a GPU
is present before importing it (nothing is launched). Writes
course_lib/data/backward_registers.json.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from course_lib.bench.common import DATA_DIR, environment
from course_lib.hardware import GPUSpec, get_gpu

ARCH = 90  # sm_90: the H100 and H200
# Of an SM's shared memory (``hardware``), 1 KiB is reserved per resident program; registers are
# handed out per thread in groups of 8 (NVIDIA, CUDA C++ Programming Guide, "Compute
# Capabilities"; Hopper Tuning Guide).
SHARED_RESERVED, REGISTER_GROUP = 1024, 8
HEAD_DIMS = (64, 128)
_CHILD = ("import sys, torch; torch.cuda.is_available = lambda: True; "
          "from course_lib.bench.registers import _rows; _rows(sys.argv[1])")


def _tiles(head_dim: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, MASK_BLOCK_M, warps, stages) of the autotuner's dK/dV candidates."""
    from course_lib.kernels import flash_bwd

    configs = flash_bwd.keep_bwd_config_for_head_dim(flash_bwd.DKDV_CONFIGS, {"HEAD_DIM": head_dim})
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["MASK_BLOCK_M"], c.num_warps,
             c.num_stages) for c in configs]


def usage(cubin: bytes) -> dict:
    """Registers, stack and static shared bytes of a cubin's kernel (``cuobjdump -res-usage``)."""
    import triton.backends.nvidia as nvidia  # the wheel's NVIDIA tools live in its bin/

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return parse_usage(out)


def parse_usage(text: str) -> dict:
    """{"registers", "stack_bytes", "shared_bytes"} from ``cuobjdump -res-usage`` output."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)", text)
    if m is None:
        raise ValueError(f"no resource usage in: {text[:200]!r}")
    return {"registers": int(m[1]), "stack_bytes": int(m[2]), "shared_bytes": int(m[3])}


def _compile(kernel, constants: dict, warps: int, stages: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction):  # through the heuristics wrapper
        fn = fn.fn
    pointers = ("Q", "K", "V", "DO", "DK", "DV", "LSE2", "Delta", "DQ_ACC")
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*fp32" if name in ("LSE2", "Delta", "DQ_ACC") else "*fp16"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "sm_scale") else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if name in pointers or name in ("N_Q", "N_K", "N_BUCKET")}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=aligned),
                              target=GPUTarget("cuda", ARCH, 128),
                              options={"num_warps": warps, "num_stages": stages})
    # (cuobjdump's SHARED is the static part; Triton's tiles are dynamic shared memory)
    return {**usage(compiled.asm["cubin"]), "shared_bytes": compiled.metadata.shared}


def _rows(out: str) -> None:
    """(child process) Compile every case and write the rows as JSON to ``out``."""
    from course_lib.kernels import flash_bwd

    rows = []
    for d in HEAD_DIMS:
        for m, n, mask_m, warps, stages in _tiles(d):
            for one_pass in (False, True):
                for causal in (False, True):
                    constants = dict(HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n, MASK_BLOCK_M=mask_m,
                                     CAUSAL=causal, DOT_PRECISION="tf32", EVEN_M=True,
                                     ONE_PASS=one_pass)
                    row = {"D": d, "BLOCK_M": m, "BLOCK_N": n, "warps": warps, "stages": stages,
                           "causal": causal, "form": "one pass" if one_pass else "two kernels"}
                    try:
                        row.update(_compile(flash_bwd._bwd_dkdv_kernel, constants, warps, stages))
                    except Exception as exc:  # noqa: BLE001 - a tile that fails is a result
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    rows.append(row)
    Path(out).write_text(json.dumps(rows))


def run() -> dict:
    """Compile in a child process; the rows with what produced them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, "-c", _CHILD, str(out)], check=True)
        rows = json.loads(out.read_text())
    return {"environment": {**environment(), "target": f"sm_{ARCH}"},
            "kernel": "flash_bwd._bwd_dkdv_kernel", "rows": rows}


def programs_per_sm(row: dict, gpu: GPUSpec | None = None) -> int:
    """How many programs of a compiled row fit on one SM of ``gpu`` (an H200 by default) at
    once, by shared memory and by registers."""
    gpu = gpu or get_gpu("H200")
    by_shared = gpu.smem_per_sm_bytes // (row["shared_bytes"] + SHARED_RESERVED)
    allocated = -(-row["registers"] // REGISTER_GROUP) * REGISTER_GROUP
    return min(by_shared, int(gpu.regs_per_sm_kib * 1024) // 4 // (allocated * 32 * row["warps"]))


def report(result: dict) -> str:
    lines = [f"dK/dV kernel for {result['environment']['target']}, triton "
             f"{result['environment']['triton']}: registers / spilled (stack) bytes / shared KiB",
             f"{'D':>4} {'tile':>8} {'w':>2} {'s':>2}  {'form':12} {'causal':7} regs  stack  smem"]
    for r in result["rows"]:
        tile = f"{r['BLOCK_M']}x{r['BLOCK_N']}"
        head = (f"{r['D']:>4} {tile:>8} {r['warps']:>2} {r['stages']:>2}  {r['form']:12} "
                f"{r['causal']!s:7}")
        if "error" in r:
            lines.append(f"{head} {r['error'][:60]}")
        else:
            kib = r["shared_bytes"] // 1024
            lines.append(f"{head} {r['registers']:>4} {r['stack_bytes']:>6} {kib:>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench registers")
    parser.add_argument("--out", default=str(DATA_DIR / "backward_registers.json"))
    args = parser.parse_args(argv)
    result = run()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))
    print(f"wrote {args.out}")
    return 0
