"""Continuous batching against static batching: the same requests through the same engine.

Introduced in notebooks/16_serving.ipynb. ``python -m course_lib.serving`` (a GPU) serves one
workload twice with ``Engine``: continuous batching (a request joins at the first step with
room) and static batching (``static=True``: a batch is formed, then runs until its last
request is done). Same model, pages, token budget and running limit; the policies take turns,
each run timed from its first step to its last token (``torch.cuda.synchronize``). Throughput is
generated tokens per second; each run's steps are kept for the timeline. Orca (Yu et al., OSDI
2022, section 5) and vLLM (Kwon et al., SOSP 2023, section 6) measure the same comparison at
scale. Result: course_lib/data/serving.json.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from course_lib.bench.common import require_gpu, save_result

WORKLOAD = dict(requests=128, prompt=(32, 512), output=(16, 256), seed=0)
ENGINE = dict(block_size=16, max_tokens_per_step=512, max_running=32)


def workload(requests: int, prompt: tuple, output: tuple, seed: int, vocab: int) -> list:
    """(prompt token ids, new tokens) per request, lengths uniform in the ranges given."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(requests)]


def serve(model, requests: list, static: bool, num_blocks: int) -> dict:
    """One run of the workload: seconds, tokens, steps, and the steps' records."""
    from course_lib.serving.engine import Engine

    engine = Engine(model, num_blocks=num_blocks, static=static, **ENGINE)
    for prompt, new in requests:
        engine.add_request(prompt, new)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs.values())
    history = engine.scheduler.history
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "steps": len(history),
            "timeline": [{"step": h.step, "prefill": h.prefill_tokens,
                          "decode": h.decode_tokens, "running": len(h.chunks)}
                         for h in history]}


def run(rounds: int = 2) -> dict:
    from course_lib.hf.capstone import llama_1b_config, make_llama

    config = llama_1b_config()
    model = make_llama(config, dtype=torch.float16, device="cuda")
    requests = workload(vocab=config.vocab_size, **WORKLOAD)
    most = sum(len(p) + n for p, n in requests)
    num_blocks = most // ENGINE["block_size"] + len(requests) + 1  # room for every request
    for static in (False, True):  # compile every kernel shape the runs meet, untimed
        serve(model, requests, static, num_blocks)
    runs = {"continuous": [], "static": []}
    for _ in range(rounds):  # in turns
        for name in runs:
            runs[name].append(serve(model, requests, name == "static", num_blocks))
    result = {"method": __doc__, "workload": WORKLOAD,
              "engine": ENGINE, "model": "Llama-3.2-1B shape, random weights, fp16",
              "runs": runs}
    tps = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    result["tokens_per_s"] = tps
    result["speedup"] = tps["continuous"] / tps["static"]
    for name, rs in runs.items():
        seconds = ", ".join("%.2f s" % r["seconds"] for r in rs)
        print(f"{name:10s} {tps[name]:8.0f} tokens/s  steps {rs[0]['steps']}  ({seconds})",
              flush=True)
    print(f"continuous / static: x{result['speedup']:.2f}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.serving",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    require_gpu("the serving benchmark")
    print("saved", save_result("serving", run(args.rounds)))
    return 0


def figure(result: dict):
    """The stored run as a picture: requests running at each step under both policies (the
    last round), and generated tokens per second of every round."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.2), layout="constrained")
    ax_steps, ax_rate = fig.subplots(1, 2, width_ratios=[2.4, 1])
    colors = {"continuous": "#2e86c1", "static": "#e67e22"}
    for name, runs in result["runs"].items():
        timeline = runs[-1]["timeline"]
        ax_steps.plot([t["step"] for t in timeline], [t["running"] for t in timeline],
                      color=colors[name], lw=1.2, label=f"{name}: {len(timeline)} steps")
    ax_steps.set_xlabel("step")
    ax_steps.set_ylabel("requests in the step")
    ax_steps.legend(frameon=False)
    ax_steps.set_title(f"{result['workload']['requests']} requests, at most "
                       f"{result['engine']['max_running']} running", loc="left")
    names = list(result["runs"])
    for i, name in enumerate(names):
        rates = [r["tokens_per_s"] for r in result["runs"][name]]
        ax_rate.bar(i, result["tokens_per_s"][name], color=colors[name], width=0.6)
        ax_rate.scatter([i] * len(rates), rates, color="black", s=12, zorder=3)
    ax_rate.set_xticks(range(len(names)), names)
    ax_rate.set_ylabel("generated tokens / s (median; dots: rounds)")
    ax_rate.set_title(result["environment"].get("gpu", ""), loc="left")
    return fig
