"""The capstone's LLaMA on a GPU, course kernels against SDPA: eager, and compiled with CUDA graphs.

    python -m course_lib.bench llama [--out course_lib/data]             # llama.json
    python -m course_lib.bench llama --compiled [--out course_lib/data]  # capstone_compiled.json

notebooks/14_llama_capstone.ipynb measures the same with these functions when it runs on a
GPU; this entry point needs no Jupyter (the GPU machines of the course's own runs have none).

* ``llama_result``: the ~1.24 B-parameter config (``hf.llama_1b_config``) in bf16, batch 1,
  prompts of 512, 2048 and 8192 tokens, eager: prefill ms and decode ms per token
  (``hf.benchmark``: the two attentions take turns call by call), plus one decode step's
  attention alone at the model's shape (``decode_step_rows``, ``do_bench`` median).
* ``compiled_result``: prompts 512 and 2048, eager and compiled (``hf.benchmark(compiled=True)``:
  a compiled prefill, and ``generate`` with a static cache and its decode step as CUDA graphs).
  It also counts the CUDA graphs each side recorded (``count_graph_recordings``): one per
  side and prompt length is the floor; more mean that a step's inputs moved and the graph was
  recorded anew, time that lands in the per-token figures.
"""
from __future__ import annotations

import argparse
import collections
import contextlib

import torch

from course_lib.bench.common import DATA_DIR, median_ms, require_gpu, save_result

CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size")


def config_record(config) -> dict:
    """The model's shape as the stored results record it."""
    return {k: getattr(config, k) for k in CONFIG_KEYS}


def decode_step_rows(n_ks=(2048, 8192, 32768)) -> list[dict]:
    """One decode step's attention at the model's shape (B 1, H 32, H_kv 8, D 64, bf16):
    ``flash_decode``, ``flash_attn_v2`` with the one query row, and SDPA, eager, do_bench
    median; µs and the KV cache's bytes per second."""
    from course_lib.ops import flash_attn_v2, flash_decode

    rows = []
    for n_k in n_ks:
        q = torch.randn(1, 32, 1, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, n_k, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * k.element_size()
        row = {"N_k": n_k}
        for name, fn in (
                ("flash_decode", lambda: flash_decode(q, k, v)),
                ("flash_attn_v2", lambda: flash_attn_v2(q, k, v, causal=True)),
                ("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True))):
            ms = median_ms(fn)
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_GB/s"] = kv_bytes / (ms * 1e-3) / 1e9
        rows.append(row)
    return rows


def llama_result(model, prompt_lengths=(512, 2048, 8192), new_tokens: int = 32) -> dict:
    """What llama.json holds: the eager rows of ``hf.benchmark`` and ``decode_step_rows``."""
    from course_lib import hf

    rows = hf.benchmark(model, prompt_lengths=prompt_lengths, batch=1, new_tokens=new_tokens)
    return {"config": config_record(model.config), "parameters": hf.n_parameters(model),
            "dtype": "bfloat16", "batch": 1, "new_tokens": new_tokens, "pairs": 20,
            "decode_steps": 3 * new_tokens, "rows": rows, "decode_step": decode_step_rows()}


@contextlib.contextmanager
def count_graph_recordings(model):
    """Count, by the model's attention implementation at the time, the CUDA graphs that
    torch.compile's CUDA-graph trees record inside the block. Yields a Counter (empty where
    this PyTorch has no such hook). Wraps the recording method rather than turning on the
    trees' debug log, which formats a reason on every failed check and costs host time."""
    counts: collections.Counter = collections.Counter()
    try:
        from torch._inductor import cudagraph_trees as trees
        manager = trees.CUDAGraphTreeManager
        record = manager.record_function
    except (ImportError, AttributeError):
        yield counts
        return

    def counted(self, *args, **kwargs):
        counts[model.config._attn_implementation] += 1
        return record(self, *args, **kwargs)

    manager.record_function = counted
    try:
        yield counts
    finally:
        manager.record_function = record


def compiled_result(model, prompt_lengths=(512, 2048), new_tokens: int = 32) -> dict:
    """What capstone_compiled.json holds: ``hf.benchmark(compiled=True)`` and the CUDA graphs
    each side recorded."""
    from course_lib import hf

    with count_graph_recordings(model) as recordings:
        rows = hf.benchmark(model, prompt_lengths=prompt_lengths, new_tokens=new_tokens,
                            compiled=True)
    return {"config": config_record(model.config), "parameters": hf.n_parameters(model),
            "dtype": "bfloat16", "batch": 1, "new_tokens": new_tokens, "pairs": 20,
            "decode_steps": 3 * new_tokens, "compiled_pairs": 5, "rows": rows,
            "cuda_graph_recordings": dict(recordings)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench llama")
    parser.add_argument("--compiled", action="store_true",
                        help="eager and compiled at 512 and 2048 tokens: capstone_compiled.json")
    parser.add_argument("--out", default=str(DATA_DIR), help="directory of the JSON file")
    args = parser.parse_args(argv)
    require_gpu("the LLaMA benchmark")
    from course_lib import hf

    model = hf.make_llama(hf.llama_1b_config(), dtype=torch.bfloat16)
    if args.compiled:
        result, name = compiled_result(model), "capstone_compiled"
        print("CUDA graphs recorded:", result["cuda_graph_recordings"])
    else:
        result, name = llama_result(model), "llama"
    print(f"wrote {save_result(name, result, args.out)}")
    for row in result["rows"]:
        print(row)
    return 0
