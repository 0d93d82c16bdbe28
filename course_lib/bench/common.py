"""Timing and bookkeeping shared by every benchmark (see METHOD: warm up, median, same run)."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import platform
import statistics
from pathlib import Path

import torch

import course_lib

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
# Where a lesson saves what it measured on the reader's GPU: beside the stored runs of data/,
# never over them (the published numbers come from data/). Ignored by git.
RUNS_DIR = Path(__file__).resolve().parents[2] / "runs"
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def require_gpu(what: str) -> None:
    if course_lib.DEVICE != "cuda":
        raise SystemExit(f"{what} needs a CUDA GPU; course_lib.DEVICE is {course_lib.DEVICE!r}. "
                         "Stored results are in course_lib/data/.")


def median_ms(fn, warmup_ms: float = 100, rep_ms: float = 500) -> float:
    """Median time of ``fn()`` in milliseconds, timed with CUDA events (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def clean_l2_median_ms(fn, reps: int = 100, warmup: int = 10) -> float:
    """Median time of ``fn()`` in milliseconds, CUDA events, after an L2 flush that leaves no
    dirty line: 256 MiB written (``do_bench``'s flush), then another 256 MiB read.

    After ``do_bench``'s write-only flush the L2 holds dirty lines (up to its size: 60 MiB on an
    H200), and the timed call pays for writing them back to HBM: a decode step that reads
    512 MiB took 135.8 µs after ``do_bench``'s flush, 127.3 µs after this one (an H200,
    course_lib/data/decode_merge.json); a 2 GiB copy hardly notices."""
    dirty = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    clean = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        dirty.zero_()
        clean.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graphed(fn):
    """A CUDA graph of ``fn()``, captured after three warm-up calls on a side stream: its
    replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compilation, autotuning, caches
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_median_ms(fn, warmup_ms: float = 100, rep_ms: float = 500) -> float:
    """Median time of replaying a CUDA graph of ``fn()``: the GPU's time, without the host's.

    For work of a few microseconds (one decode step) the Python and launch overhead of an eager
    call can exceed the kernels' time; serving systems replay graphs for the same reason.
    """
    return median_ms(graphed(fn), warmup_ms=warmup_ms, rep_ms=rep_ms)


@contextlib.contextmanager
def sdpa_backend(name: str):
    """Force one PyTorch SDPA backend ('FLASH_ATTENTION', 'CUDNN_ATTENTION', ...)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, name)):
        yield


def copy_bandwidth_gbs(nbytes: int = 2 << 30, timer=median_ms) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written; ``timer``
    (ms of a call): ``median_ms`` or ``clean_l2_median_ms``."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """A large dense matmul through torch (cuBLAS): the compute ceiling measured in this run."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def environment() -> dict:
    """What produced a result: GPU, versions, date. Stored with every JSON file."""
    import triton

    env = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "device": course_lib.DEVICE}
    if course_lib.DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"sm_{props.major}{props.minor}",
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return env


def save_result(name: str, payload: dict, directory: Path | None = None) -> Path:
    """Write ``payload`` plus the environment to ``<directory>/<name>.json``."""
    directory = Path(directory or DATA_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=1) + "\n")
    return path


def load_result(name: str) -> dict | None:
    """The stored result ``course_lib/data/<name>.json``, or None if it was never measured."""
    path = DATA_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def describe_error(exc: BaseException) -> str:
    """One line naming an exception, for a provider's record in a result file."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def in_turns(fns: dict, rounds: int = 3, rep_ms: float = 500) -> tuple[dict, dict]:
    """Time the providers ``fns`` ({name: callable}) in turns: each called once first (compile,
    autotune; one that raises is recorded and left out), then ``rounds`` rounds of A, B, C, ...,
    each a ``median_ms``. Returns ({name: [ms of each round]}, {name: error}). Taking turns
    spreads a slow spell of the GPU (clocks, a neighbour) over every provider alike."""
    times, errors = {name: [] for name in fns}, {}
    for name, fn in fns.items():
        try:
            fn()
        except Exception as exc:  # (out of shared memory, an older torch)
            errors[name] = describe_error(exc)
    for _ in range(rounds):
        for name, fn in fns.items():
            if name not in errors:
                times[name].append(median_ms(fn, rep_ms=rep_ms))
    return times, errors


def sweep(shape_list, providers, measure, derive, desc: str, label, progress: bool = True,
          rounds: int = 1):
    """``measure(provider, shape) -> dict`` for every shape and provider, with a progress bar.

    A provider that raises is recorded as ``{"ms": None, "error": ...}`` and the sweep goes on
    (a refusing backend is a result). With ``rounds`` > 1 every provider of a shape is measured
    again in turn, round after round (A B C, A B C, ...), and its ``ms`` is the median over the
    rounds (all of them in ``ms_rounds``): a GPU's clock and power state drift by several per
    cent within seconds, and interleaving spreads that drift over every provider alike.
    ``derive(shape, rec)`` adds the subject's own fields to each record; ``label(shape)`` names
    the shape on the bar. Returns ``[(shape, {provider: record})]`` in order.
    """
    from tqdm.auto import tqdm

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    out = []
    bar = tqdm(total=len(shape_list) * len(providers) * rounds, disable=not progress,
               unit="run", desc=desc)
    for shape in shape_list:
        runs = {name: [] for name in providers}
        for _ in range(rounds):
            for name in providers:
                bar.set_postfix_str(f"{label(shape)} {name}")
                if runs[name] and runs[name][-1].get("ms") is None:
                    bar.update()  # failed or skipped once: not tried again
                    continue
                try:
                    rec = dict(measure(name, shape))
                except Exception as exc:
                    rec = {"ms": None, "error": describe_error(exc)}
                rec.setdefault("error", None)
                runs[name].append(rec)
                bar.update()
        results = {}
        for name, recs in runs.items():
            rec = _merge_rounds(recs)
            derive(shape, rec)
            results[name] = rec
        out.append((shape, results))
    bar.close()
    return out


def _merge_rounds(recs: list[dict]) -> dict:
    """One record from a provider's rounds: the last failure if any, else the median time."""
    if len(recs) == 1 or recs[-1].get("ms") is None:
        return recs[-1]
    times = [r["ms"] for r in recs]
    return {**recs[0], "ms": statistics.median(times), "ms_rounds": times}


def format_table(rows: list[dict], columns: list[str], floatfmt: str = "{:.1f}") -> str:
    """A plain-text table (no dependency) of ``rows`` restricted to ``columns``."""
    cells = [[c for c in columns]]
    for r in rows:
        cells.append([floatfmt.format(r[c]) if isinstance(r.get(c), float) else
                      ("-" if r.get(c) is None else str(r[c])) for c in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
