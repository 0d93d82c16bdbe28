"""``./course gpu-check``: every GPU path of the course, checked by one command on one GPU.

On an NVIDIA GPU, in this order:

1. a smoke benchmark, the GPU to itself: ``flash_attn_v2``'s forward and backward and
   ``flash_decode`` against PyTorch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends, one
   harness for both sides (``triton.testing.do_bench`` median, the providers in turns);
2. side by side: every test (the ``gpu``-marked ones run), every notebook at its GPU size
   (nbval, as ``./course test`` runs them on a CPU), and ``python -m course_lib.exercises
   verify`` with the kernels compiled;
3. the record, ``course_lib/data/gpu_check.json``: the commit, the GPU, torch and triton, the
   passed / failed / skipped counts with the failures' names, the wall time, the benchmark; and
   a short table.

Exit status 0 only when nothing failed. The module is also the pytest plugin that writes each
test's outcome to a log as it ends (``-p course_lib.gpu_check``, the log named by
``COURSE_GPU_CHECK_LOG``), so a run stopped by a time limit still says what it reached.

    ./course gpu-check                    # everything, about 8 minutes on an H200
    ./course gpu-check --only tests       # one part: bench, tests, notebooks or exercises
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "course_lib" / "data" / "gpu_check.json"
LOG_VAR = "COURSE_GPU_CHECK_LOG"
NBVAL = ["--nbval-lax", "--nbval-current-env", "--nbval-sanitize-with",
         "tests/nbval_sanitize.cfg", "--nbval-cell-timeout", "600"]
PARTS = ("bench", "tests", "notebooks", "exercises")


# ---------------------------------------------------------------------------------------------
# the pytest plugin: one JSON line per test phase, written as it ends
# ---------------------------------------------------------------------------------------------

def pytest_runtest_logreport(report):
    path = os.environ.get(LOG_VAR)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # xdist's workers hand their reports to the controller, which writes them
    if report.when != "call" and report.passed:
        return  # set-up and tear-down that passed say nothing
    message = ""
    if report.failed:
        text = str(report.longrepr or "")
        lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()
        message = " | ".join(ln.strip() for ln in lines[:3])[:400]
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])[:200]
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": round(report.duration, 3), "message": message}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def outcomes(log_path) -> dict:
    """{nodeid: (outcome, duration, message)} from a plugin log: a test failed if any of its
    phases failed, was skipped if its set-up said so, and passed otherwise."""
    out = {}
    if not Path(log_path).exists():
        return out
    for raw in Path(log_path).read_text().splitlines():
        rec = json.loads(raw)
        node, old = rec["nodeid"], out.get(rec["nodeid"])
        if rec["outcome"] == "failed":
            outcome = "failed"
        elif rec["outcome"] == "skipped":
            outcome = "skipped"
        else:
            outcome = "passed"
        if old is None or old[0] == "passed" or (old[0] == "skipped" and outcome == "failed"):
            out[node] = (outcome, rec["duration"] + (old[1] if old else 0), rec["message"])
    return out


# ---------------------------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------------------------

def _commit() -> str:
    """The commit checked out, with '+changes' when the working tree differs from it; or the
    value of COURSE_COMMIT where the tree is a copy without git (a lent GPU machine)."""
    if os.environ.get("COURSE_COMMIT"):
        return os.environ["COURSE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _environment() -> dict:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _commit(), "gpu": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}


# The test files that run the course's code on the device (kernels, operators, models,
# benchmarks, exercises' kernels through ``exercises verify``); the others test what runs on
# the CPU alone (figures, slides, the stored numbers, NumPy models, the browser) and run in CI.
# tests/test_gpu_check.py holds every test file to one of the two lists.
GPU_TESTS = ("test_bench.py", "test_cascade.py", "test_decode.py", "test_flash_bwd.py",
             "test_flash_fp8.py", "test_flash_v1.py", "test_flash_v2.py", "test_flash_v2_plan.py",
             "test_flash_variants.py", "test_flash_variants_bwd.py", "test_foundation.py",
             "test_hardware.py", "test_hf.py", "test_kv_quant.py", "test_kvcache.py",
             "test_matmul.py", "test_ops.py", "test_puzzles.py", "test_serving_engine.py",
             "test_tree_attention.py")
CPU_TESTS = ("test_architecture.py", "test_block_map.py", "test_browser_notebooks.py",
             "test_browser_widgets.py", "test_device_asserts.py", "test_environment.py",
             "test_exercise_leaks.py", "test_exercises.py", "test_figures.py", "test_fp8.py",
             "test_gpu_check.py", "test_iomodel_attention.py", "test_iomodel_backward.py",
             "test_iomodel_matmul.py", "test_iomodel_variants.py", "test_masks.py",
             "test_notebooks_meta.py", "test_predict.py", "test_reference.py",
             "test_results.py", "test_slides.py", "test_softmax.py", "test_sources.py",
             "test_speculative.py")


def _longest_first(paths: list[str]) -> list[str]:
    """``paths`` ordered by the seconds the stored record spent in each, longest first (pytest
    collects in the order given, so the longest notebooks start first); unknown ones first."""
    try:
        seconds = json.loads(RECORD.read_text()).get("files", {})
    except (OSError, ValueError):
        seconds = {}
    return sorted(paths, key=lambda p: -seconds.get(p, float("inf")))


def _pytest(targets, workers: int, dist: str) -> list[str]:
    timeout = ["--timeout", "300"] if _has("pytest_timeout") else []
    return [sys.executable, "-m", "pytest", "-q", "-p", "course_lib.gpu_check",
            "-p", "no:cacheprovider", "-n", str(workers), "--dist", dist, *timeout,
            *NBVAL, *targets]


def _balanced() -> str:
    """xdist's scheduling for tests of uneven length: "worksteal" (xdist >= 3.2: an idle worker
    takes half of a busy one's queue), else "load"."""
    import xdist

    major, minor = (int(x) for x in xdist.__version__.split(".")[:2])
    return "worksteal" if (major, minor) >= (3, 2) else "load"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _start(cmd, log: Path, out_file: Path, threads: int = 1) -> subprocess.Popen:
    env = dict(os.environ, COURSE_DEVICE="cuda", PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, str(threads))  # a process per core: no pool of threads in each
    env[LOG_VAR] = str(log)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    log.unlink(missing_ok=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out_file, "w"),
                            stderr=subprocess.STDOUT)


def _wait(procs: dict, deadline: float) -> dict:
    """Wait for every process until ``deadline`` (perf_counter); kill what is left. Returns
    {name: (seconds it ran, whether it was stopped)}."""
    start, ended = time.perf_counter(), {}
    while len(ended) < len(procs):
        for name, p in procs.items():
            if name not in ended and p.poll() is not None:
                ended[name] = (time.perf_counter() - start, False)
        if time.perf_counter() > deadline:
            for name, p in procs.items():
                if name not in ended:
                    p.kill()
                    p.wait()
                    ended[name] = (time.perf_counter() - start, True)
        time.sleep(0.5)
    return ended


def _part(name: str, p, seconds: float, stopped: bool, work: Path) -> dict:
    """Counts, failures and slowest items of one part."""
    part = {"returncode": p.returncode, "timed_out": stopped, "wall_s": round(seconds, 1)}
    out = (work / f"{name}.out").read_text().strip().splitlines()
    if name == "exercises":
        ok = p.returncode == 0 and not stopped
        return {**part, "passed": int(ok), "failed": int(not ok), "skipped": 0,
                "summary": out[-1] if out else "", "failures": [] if ok else out[-3:]}
    found = outcomes(work / f"{name}.jsonl")
    part.update({k: sum(1 for v in found.values() if v[0] == k)
                 for k in ("passed", "failed", "skipped")})
    part["failures"] = [f"{n}: {m}" for n, (o, _, m) in found.items() if o == "failed"]
    if stopped or (p.returncode != 0 and not part["failures"]):
        part["failures"].append(f"{name}: exit {p.returncode}"
                                f"{' (time limit)' if stopped else ''}: "
                                + " | ".join(out[-5:])[-600:])
        part["failed"] += 1
    files: dict = {}
    for n, (_, d, _) in found.items():
        files[n.split("::")[0]] = files.get(n.split("::")[0], 0) + d
    part["files"] = {f: round(d, 1) for f, d in sorted(files.items(), key=lambda x: -x[1])}
    return part


def run(parts=PARTS, workers: int | None = None, budget_s: float = 540,
        work_dir: Path | None = None, record: Path = RECORD) -> dict:
    """Run the check; returns (and writes to ``record``) what it found."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu-check needs a CUDA GPU: torch sees none")
    t0 = time.perf_counter()
    work = Path(work_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    workers = workers or max(3, (os.cpu_count() or 4) - 1)
    result = {"environment": _environment(), "parts": {}}
    if "bench" in parts:  # first, with the GPU to itself
        from course_lib.bench.smoke import smoke

        result["bench"] = smoke()
        result["parts"]["bench"] = {"wall_s": round(time.perf_counter() - t0, 1)}
    # the tests are the longest part: they get the cores the exercises and the notebooks free
    # when they end (one process too many while all three run; compiles are CPU-bound)
    nb_workers = max(1, min(4, workers // 3))
    notebooks = _longest_first([str(p.relative_to(ROOT))
                                for p in sorted((ROOT / "notebooks").glob("*.ipynb"))])
    tests = _longest_first([f"tests/{f}" for f in GPU_TESTS])
    commands = {
        "tests": _pytest(tests, max(1, workers - nb_workers + 1), _balanced()),
        "notebooks": _pytest(notebooks, nb_workers, "loadfile"),
        "exercises": [sys.executable, "-m", "course_lib.exercises", "verify", "--quiet"],
    }
    procs = {name: _start(cmd, work / f"{name}.jsonl", work / f"{name}.out")
             for name, cmd in commands.items() if name in parts}
    for name, (seconds, stopped) in _wait(procs, t0 + budget_s).items():
        result["parts"][name] = _part(name, procs[name], seconds, stopped, work)
    result["files"] = {f: d for part in result["parts"].values()
                       for f, d in part.pop("files", {}).items()}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["failed"] = sum(p.get("failed", 0) for p in result["parts"].values())
    record = Path(record)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(result: dict) -> str:
    env = result["environment"]
    lines = [f"gpu-check on {env['gpu']} ({env['sm_count']} SMs), torch {env['torch']}, "
             f"triton {env['triton']}, commit {env['commit'][:12]}, {env['date']}",
             f"{'part':<10} {'passed':>7} {'failed':>7} {'skipped':>8} {'wall s':>8}"]
    for name, p in result["parts"].items():
        if name == "bench":
            continue
        lines.append(f"{name:<10} {p['passed']:>7} {p['failed']:>7} {p['skipped']:>8} "
                     f"{p['wall_s']:>8.0f}")
    if "bench" in result["parts"]:
        lines.append(f"{'bench':<10} {'':>7} {'':>7} {'':>8} "
                     f"{result['parts']['bench']['wall_s']:>8.0f}")
    for name, p in result["parts"].items():
        for f in p.get("failures", []):
            lines.append(f"FAILED {f[:300]}")
    if "bench" in result:
        from course_lib.bench.smoke import table as bench_table

        lines.append(bench_table(result["bench"]))
    lines.append(f"wall time {result['wall_s']:.0f} s; {result['failed']} failed")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="./course gpu-check", description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--workers", type=int, default=None,
                    help="the cores to fill (default: all but one): the notebooks take a third "
                         "(at most 4), the exercises one, the tests the rest and two more")
    ap.add_argument("--budget", type=float, default=540, help="seconds before parts are stopped")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the logs go")
    ap.add_argument("--record", type=Path, default=RECORD)
    args = ap.parse_args(argv)
    result = run(args.only, args.workers, args.budget, args.work_dir, args.record)
    print(table(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
