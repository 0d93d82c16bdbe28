"""The capstone's LLaMA with the course's kernels (notebooks/14_llama_capstone.ipynb).

Configs (a small one for the CPU, ~1B parameters for a GPU; ``small_config`` for tiny LLaMA,
Mistral, Gemma 2 and GPT-OSS), a random-weight model, greedy decoding with a cache, the GPU
timing of prefill and per-token decode against SDPA, and the stored runs (``python -m
course_lib.hf [--compiled]`` writes course_lib/data/llama.json or capstone_compiled.json). The
models use the attention of ``course_lib.hf.attention`` by its registered name. transformers is
an optional extra of the course (``pip install -e ".[hf]"``); nothing is downloaded: every model
here is built from a config.

Measured speed (course_lib/data/llama.json, drawn by ``course_lib.diagrams.capstone``; NVIDIA
H100 80GB HBM3, torch 2.11, the 1.24 B-parameter config in bf16, batch 1; both sides timed the
same way, eager PyTorch, in turns, wall clock between ``torch.cuda.synchronize()`` calls:
``time_prefills_in_turns`` and ``time_decodes_in_turns`` below): prefill of 8192 tokens 51.0 ms
with the course kernels against 52.3 ms with SDPA (512 tokens: 10.5 and 11.3 ms); decode
9.9–11.2 ms per token with the course kernels and 10.4–11.7 ms with SDPA, from 512 to 8192
tokens of context (at 512 ours was the faster step in 78 of 96 pairs): bound by the host's
work per token (launches, Python, the cache's copies) more than by the GPU's attention.
Compiled, with a static cache and the decode step as a CUDA graph
(``time_compiled_decodes_in_turns``, ``time_prefills_in_turns`` with ``compiled=True``;
course_lib/data/capstone_compiled.json, both sides in one run), a token takes a fraction of its
eager time on both sides (2.42 against 2.66 ms at a 512-token prompt, 3.19 against 3.81 ms at
2048); notebooks/14_llama_capstone.ipynb, section 7, shows the result, and its appendix
notebooks/14a_capstone_measurements.ipynb every number, generated from that file.
"""
from __future__ import annotations

import collections
import contextlib
import time

import torch

from course_lib._device import DEVICE
from course_lib.hf.attention import (  # (first: it names the extra when transformers is missing)
    ATTN_IMPLEMENTATION,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from course_lib.ops import flash_attn_v2, flash_decode

# ---------------------------------------------------------------------------------------------
# the capstone's models
# ---------------------------------------------------------------------------------------------

def small_llama_config(**overrides) -> LlamaConfig:
    """A LLaMA small enough for Triton's interpreter: 4 layers, 8 heads, 2 KV heads (GQA).

    Weights are drawn with std 0.1 (LLaMA's default is 0.02): attention scores are then
    sharp and greedy text does not loop on one token, so matching tokens is a real test.
    """
    cfg = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, head_dim=32, initializer_range=0.1,
               max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def llama_1b_config(**overrides) -> LlamaConfig:
    """The shape of Llama-3.2-1B (16 layers, 32 heads, 8 KV heads, D = 64; random weights)."""
    cfg = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)
    cfg.update(overrides)
    return LlamaConfig(**cfg)


SMALL_WINDOW = 8  # the sliding window of small_config's models, shorter than the tests' prompts


def small_config(family: str = "llama", **overrides):
    """A tiny config of an open model family whose attention ``course_attention_forward``
    serves, small enough for Triton's interpreter: 2 layers, hidden 64, 4 heads and 2 KV heads
    (GQA) of D = 16, a vocabulary of 128, weights drawn with std 0.1 (see ``small_llama_config``).

    * ``"llama"``: plain causal attention;
    * ``"mistral"``: a sliding window of ``SMALL_WINDOW`` keys on every layer;
    * ``"gemma2"``: sliding (``SMALL_WINDOW``) and global layers in turn, attention logits
      soft-capped at 2 (Gemma 2's 50 would never bend scores this small) and scaled by
      query_pre_attn_scalar^-0.5 = 24^-0.5, not D^-0.5;
    * ``"gpt_oss"``: sliding and global layers in turn, learned sinks; two experts, both used by
      every token (a top-2 of more experts flips with the last bits, and the logits jump).
    """
    from transformers import Gemma2Config, GptOssConfig, MistralConfig

    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
               max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
               eos_token_id=None, pad_token_id=None)
    family_cfg = {
        "llama": (LlamaConfig, {}),
        "mistral": (MistralConfig, dict(sliding_window=SMALL_WINDOW)),
        "gemma2": (Gemma2Config, dict(sliding_window=SMALL_WINDOW, attn_logit_softcapping=2.0,
                                      query_pre_attn_scalar=24)),
        "gpt_oss": (GptOssConfig, dict(sliding_window=SMALL_WINDOW, num_local_experts=2,
                                       num_experts_per_tok=2,
                                       max_position_embeddings=4096 * 32)),  # (its YaRN's)
    }
    if family not in family_cfg:
        raise ValueError(f"family must be one of {sorted(family_cfg)}, got {family!r}")
    config_class, extra = family_cfg[family]
    cfg.update(extra)
    cfg.update(overrides)
    return config_class(**cfg)


def make_llama(config: LlamaConfig, attn_implementation: str = ATTN_IMPLEMENTATION,
               dtype=torch.float32, device=None, seed: int = 0) -> LlamaForCausalLM:
    """A LLaMA (or the model of any config, ``small_config``) with seeded random weights, in
    eval mode. Switch attention later with ``model.set_attn_implementation(name)``: same
    weights, another kernel."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return model.to(device=device or DEVICE, dtype=dtype).eval()


def n_parameters(model) -> int:
    """Parameters of a model (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def count_parameters(config: LlamaConfig) -> int:
    """Parameters of the model a config describes, counted without allocating it."""
    with torch.device("meta"):
        return n_parameters(LlamaForCausalLM(config))


@torch.inference_mode()
def greedy(model, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``new_tokens`` greedy tokens (B, new_tokens) from ``model.generate`` with its KV cache."""
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, pad_token_id=0)
    return out[:, input_ids.shape[1]:]


# ---------------------------------------------------------------------------------------------
# GPU timing: prefill and per-token decode, our kernels against SDPA
# ---------------------------------------------------------------------------------------------

def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def static_compile_config(backend: str | None = None):
    """The ``CompileConfig`` for ``generate`` with ``cache_implementation="static"``: the decode
    step compiled with ``fullgraph=True`` and static shapes. On a GPU, Inductor with CUDA graphs
    (``mode="reduce-overhead"``); on a CPU, ``"aot_eager"``: AOTAutograd without code
    generation, which traces through the operators' fake implementations as Inductor does and
    then runs the real kernels in the interpreter. transformers compiles on GPUs only unless
    ``_compile_all_devices`` is set."""
    from transformers import CompileConfig

    on_gpu = DEVICE == "cuda"
    config = CompileConfig(fullgraph=True, dynamic=False,
                           backend=backend or ("inductor" if on_gpu else "aot_eager"),
                           mode="reduce-overhead" if on_gpu else "default")
    config._compile_all_devices = True
    return config


@torch.inference_mode()
def time_decode(model, input_ids: torch.Tensor, new_tokens: int = 32, repeats: int = 3) -> float:
    """Median ms per generated token after a prompt of ``input_ids``: a greedy loop with the
    model's DynamicCache, one token per forward (the prefill is not timed)."""
    per_token = []
    for r in range(repeats + 1):
        out = model(input_ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        _sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        _sync()
        if r:
            per_token.append((time.perf_counter() - t0) * 1e3 / new_tokens)
        del cache, out
    return _median(per_token)


@torch.inference_mode()
def time_prefills_in_turns(model, input_ids: torch.Tensor, implementations, pairs: int = 20,
                           compiled: bool = False, samples: dict | None = None) -> dict[str, float]:
    """Median ms of one prefill (a forward over the prompt, no cache kept) for each attention
    implementation, the implementations called in turns: A, B, A, B, ... ``pairs`` times after
    two rounds of warm-up.

    A prefill of a short prompt is bound by the host's launches on both sides, and whatever
    else the host does drifts over seconds; turns at the scale of one call put both sides
    under the same drift. ``compiled``: ``torch.compile(model, fullgraph=True,
    dynamic=False)``, made once; each implementation compiles its own graph on its first call
    (the guard on ``config._attn_implementation`` keeps both). ``samples``: a dict that gets
    every timed call, {implementation: [ms, ...]} in turn order (``paired``)."""
    run = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    times = {impl: [] for impl in implementations}
    for r in range(pairs + 2):  # two rounds of warm-up: compile, then settle
        for impl in implementations:
            model.set_attn_implementation(impl)
            _sync()
            t0 = time.perf_counter()
            run(input_ids, use_cache=False, logits_to_keep=1)
            _sync()
            if r >= 2:
                times[impl].append((time.perf_counter() - t0) * 1e3)
    return _medians(times, samples)


def _medians(times: dict, samples: dict | None) -> dict[str, float]:
    if samples is not None:
        samples.update(times)
    return {impl: _median(t) for impl, t in times.items()}


def paired(ours: list[float], theirs: list[float]) -> dict:
    """Two implementations timed in turns, compared pair by pair (the i-th time of one with
    the i-th of the other, taken one right after the other): how many pairs, the share of them
    in which ``ours`` was the faster, and the median of ours / theirs over the pairs. A median
    of each side says which is faster; these say how often, and by how much in a typical
    pair, when the host's drift moves both."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired needs two lists of one length, got {len(ours)} and "
                         f"{len(theirs)}")
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"pairs": len(ours), "won": sum(a < b for a, b in zip(ours, theirs)) / len(ours),
            "ratio_median": _median(ratios)}


@torch.inference_mode()
def time_decodes_in_turns(model, input_ids: torch.Tensor, implementations,
                          new_tokens: int = 32, repeats: int = 3,
                          samples: dict | None = None) -> dict[str, float]:
    """Median ms of one greedy decode step (one token's forward against the model's
    DynamicCache) for each attention implementation, the implementations stepping in turns.

    Each implementation gets its own cache from a prefill of ``input_ids`` (not timed). Then,
    token after token, each takes one step, timed from a synchronisation to the next (as
    ``generate`` waits for every token); ``repeats`` runs of ``new_tokens`` steps after one
    run of warm-up, the median of all the steps. An eager step is bound by the host, whose
    speed drifts by tens of percent over seconds on these machines: steps taken in turns see
    the same drift. ``samples``: as in ``time_prefills_in_turns``."""
    steps = {impl: [] for impl in implementations}
    for r in range(repeats + 1):
        state = {}
        for impl in implementations:
            model.set_attn_implementation(impl)
            out = model(input_ids, use_cache=True, logits_to_keep=1)
            state[impl] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
        for _ in range(new_tokens):
            for impl in implementations:
                model.set_attn_implementation(impl)
                cache, tok = state[impl]
                _sync()
                t0 = time.perf_counter()
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                _sync()
                if r:
                    steps[impl].append((time.perf_counter() - t0) * 1e3)
                state[impl] = (out.past_key_values, tok)
        del state, out
    return _medians(steps, samples)


def _prompts(model, prompt_lengths, batch: int) -> dict:
    """{length: (batch, length) random token ids}, the same for every benchmark (one fixed
    generator)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return {n: torch.randint(0, model.config.vocab_size, (batch, n), generator=gen)
            .to(model.device) for n in prompt_lengths}


def _generate_ms(model, input_ids: torch.Tensor, new_tokens: int, config) -> float:
    """Wall ms of one greedy ``generate`` of ``new_tokens`` tokens with a static cache and the
    compiled decode step of ``config``."""
    _sync()
    t0 = time.perf_counter()
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0, cache_implementation="static", compile_config=config)
    _sync()
    return (time.perf_counter() - t0) * 1e3


@torch.inference_mode()
def time_compiled_decodes_in_turns(model, input_ids: torch.Tensor, implementations,
                                   new_tokens: int = 32, pairs: int = 5,
                                   samples: dict | None = None) -> dict[str, float]:
    """Median ms per token of the compiled decode for each attention implementation, the
    implementations in turns.

    ``generate`` with a static KV cache (``cache_implementation="static"``), whose decode step
    transformers compiles with ``fullgraph=True`` and, on a GPU, ``mode="reduce-overhead"``
    (CUDA graphs). Each implementation compiles and records its own graphs in two warm-up
    runs (the guard on ``config._attn_implementation`` keeps both); then, ``pairs`` times, each
    runs 1 + ``new_tokens`` tokens and 1 token, and ms/token = the difference / ``new_tokens``
    (the eager prefill inside ``generate`` cancels out). ``generate``'s own host work per token
    drifts by over 10% from run to run: turns put both sides under the same drift.
    ``samples``: as in ``time_prefills_in_turns`` (ms per token of each turn)."""
    config = static_compile_config()
    per_token = {impl: [] for impl in implementations}
    for r in range(pairs + 2):  # two rounds of warm-up: compile, then record the graphs
        for impl in implementations:
            model.set_attn_implementation(impl)
            many = _generate_ms(model, input_ids, new_tokens + 1, config)
            if r >= 2:
                one = _generate_ms(model, input_ids, 1, config)
                per_token[impl].append((many - one) / new_tokens)
    return _medians(per_token, samples)


@torch.inference_mode()
def _settle(model, input_ids: torch.Tensor, implementations, seconds: float = 10.0) -> None:
    """Eager forwards of each implementation in turn for ``seconds``, untimed. The first
    seconds of a fresh process ran a host-bound step up to 70% slower than the minutes after
    (lazy initialisation, the host's clocks); whichever row came first paid for it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for impl in implementations:
            model.set_attn_implementation(impl)
            model(input_ids, use_cache=False, logits_to_keep=1)
    _sync()


def benchmark(model, prompt_lengths=(512, 2048, 8192), batch: int = 1, new_tokens: int = 32,
              implementations=(ATTN_IMPLEMENTATION, "sdpa"), compiled: bool = False,
              pairs: int = 20, repeats: int = 3, compiled_pairs: int = 5) -> list[dict]:
    """Prefill ms and decode ms/token for each prompt length and attention implementation.

    One model, its attention switched by name, so the weights are the same for every row.
    After ``_settle``, eager, the implementations in turns: the prefill ``pairs`` times each
    (``time_prefills_in_turns``), the decode step by step, ``repeats`` runs of ``new_tokens``
    steps each (``time_decodes_in_turns``); medians. With ``compiled`` also the compiled
    prefill (``time_prefills_in_turns(compiled=True)``) and the compiled decode
    (``time_compiled_decodes_in_turns``, ``compiled_pairs`` turns), columns
    ``prefill_ms_compiled_<impl>`` and ``decode_ms_compiled_<impl>``. With two
    implementations each row also has ``paired``: for each measure, the first implementation
    against the second, pair by pair (``paired``).
    """
    rows = []
    prompts = _prompts(model, prompt_lengths, batch)
    _settle(model, prompts[min(prompts)], implementations)

    def compare(row, measure, samples):
        if len(implementations) == 2:
            row.setdefault("paired", {})[measure] = paired(*(samples[i] for i in implementations))

    for n, ids in prompts.items():  # every eager run first: a compiled run leaves caches behind
        row = {"prompt": n, "batch": batch}
        prefills, decodes = {}, {}
        for impl, value in time_prefills_in_turns(model, ids, implementations, pairs,
                                                  samples=prefills).items():
            row[f"prefill_ms_{impl}"] = value
        for impl, value in time_decodes_in_turns(model, ids, implementations, new_tokens,
                                                 repeats, samples=decodes).items():
            row[f"decode_ms_{impl}"] = value
        compare(row, "prefill", prefills)
        compare(row, "decode", decodes)
        print(row, flush=True)
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in rows if compiled else []:
        ids = prompts[row["prompt"]]
        prefills, decodes = {}, {}
        torch._dynamo.reset()
        for impl, value in time_prefills_in_turns(model, ids, implementations, pairs,
                                                  compiled=True, samples=prefills).items():
            row[f"prefill_ms_compiled_{impl}"] = value
        torch._dynamo.reset()
        for impl, value in time_compiled_decodes_in_turns(model, ids, implementations,
                                                          new_tokens, compiled_pairs,
                                                          samples=decodes).items():
            row[f"decode_ms_compiled_{impl}"] = value
        compare(row, "prefill_compiled", prefills)
        compare(row, "decode_compiled", decodes)
        print(row, flush=True)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return rows


# ---------------------------------------------------------------------------------------------
# the stored runs: llama.json and capstone_compiled.json (python -m course_lib.hf [--compiled])
# ---------------------------------------------------------------------------------------------

CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size")


def config_record(config) -> dict:
    """The model's shape as the stored results record it."""
    return {k: getattr(config, k) for k in CONFIG_KEYS}


def _run_record(model, new_tokens: int) -> dict:
    """What both stored runs say of the model and of ``benchmark``'s defaults (20 prefills
    each, 3 runs of ``new_tokens`` decode steps)."""
    return {"config": config_record(model.config), "parameters": n_parameters(model),
            "dtype": "bfloat16", "batch": 1, "new_tokens": new_tokens, "pairs": 20,
            "decode_steps": 3 * new_tokens}


def decode_step_rows(n_ks=(2048, 8192, 32768)) -> list[dict]:
    """One decode step's attention at the 1B model's shape (B 1, H 32, H_kv 8, D 64, bf16):
    ``flash_decode``, ``flash_attn_v2`` with the one query row, and SDPA, all eager,
    ``do_bench`` median; µs and the KV cache's bytes per second."""
    from course_lib.bench.common import median_ms

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
    """What course_lib/data/llama.json holds: ``benchmark``'s eager rows (prefill and decode,
    the two attentions in turns) and ``decode_step_rows``."""
    rows = benchmark(model, prompt_lengths=prompt_lengths, batch=1, new_tokens=new_tokens)
    return {**_run_record(model, new_tokens), "rows": rows, "decode_step": decode_step_rows()}


@contextlib.contextmanager
def count_graph_recordings(model):
    """Count, by the model's attention implementation at the time, the CUDA graphs that
    torch.compile's CUDA-graph trees record inside the block; yields a Counter (left empty
    where this PyTorch has no such method). One graph per side and prompt length is the floor;
    each one more means that a step's inputs moved, and its recording lands in the time per
    token. This wraps the recording method: the trees' debug log would say why, but it
    formats a reason on every failed check, a cost on every step."""
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
    """What course_lib/data/capstone_compiled.json holds: ``benchmark(compiled=True)`` (eager,
    then a compiled prefill and ``generate``'s compiled decode with CUDA graphs) and the CUDA
    graphs each side recorded."""
    with count_graph_recordings(model) as recordings:
        rows = benchmark(model, prompt_lengths=prompt_lengths, new_tokens=new_tokens,
                         compiled=True)
    return {**_run_record(model, new_tokens), "compiled_pairs": 5, "rows": rows,
            "cuda_graph_recordings": dict(recordings)}


def main(argv=None) -> int:
    """python -m course_lib.hf [--compiled] [--out DIR]: the capstone's GPU runs without
    Jupyter (notebook 14 calls the same functions when it runs on a GPU)."""
    import argparse

    from course_lib.bench.common import DATA_DIR, require_gpu, save_result

    parser = argparse.ArgumentParser(prog="python -m course_lib.hf")
    parser.add_argument("--compiled", action="store_true",
                        help="eager and compiled at 512 and 2048 tokens: capstone_compiled.json "
                             "(default: eager at 512, 2048, 8192 tokens: llama.json)")
    parser.add_argument("--out", default=str(DATA_DIR), help="directory of the JSON file")
    args = parser.parse_args(argv)
    require_gpu("the LLaMA benchmark")
    model = make_llama(llama_1b_config(), dtype=torch.bfloat16)
    if args.compiled:
        result, name = compiled_result(model), "capstone_compiled"
        print("CUDA graphs recorded:", result["cuda_graph_recordings"])
    else:
        result, name = llama_result(model), "llama"
    print(f"wrote {save_result(name, result, args.out)}")
    return 0


