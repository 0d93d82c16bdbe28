"""Exercises and think-questions of notebooks/11_kv_cache_gqa.ipynb, 12_flash_decoding.ipynb
and 13_paged_attention.ipynb.

* 11: ``kv_cache_bytes`` (Python) — the KV cache of a real checkpoint from its config.json
  (``CONFIGS``): the head dim, the K/V heads and the bytes of a number are derived, not given;
* 12: ``merge_partials`` (Python) — Flash-Decoding's reduction for one query row, in NumPy;
  ``split_kv`` (Triton, ``course_lib.exercises.flash_decoding``) — the split kernel's loop
  body, the lesson's main exercise; ``merge_kernel`` (Triton) — the merge as a kernel, one
  program per query row: the stable merge (the max, the weights, the masked read of o_s, the
  sums);
* 13: ``physical_slot`` (Python) — a block-table lookup, logical position -> (block, offset);
  ``paged_gather`` (Triton) — gather a paged K cache into a contiguous one: the student writes
  the loop body (each key's physical block and slot through the table, its row in the pool,
  the masks, the copy); ``shared_blocks`` (Python) — blocks used by parallel samples that
  share their prompt, with copy-on-write.

The reference solutions are the ``*_solution`` functions and kernels below (also tested in
tests/test_decode.py and tests/test_kvcache.py); the notebooks show only the stubs. The
checkers of ``kv_cache_bytes`` and ``paged_gather`` diagnose a wrong answer
(``course_lib.exercises.diagnose``): which registered mistake its outputs look like.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib.exercises import (
    KERNEL_NUDGES,
    Exercise,
    Mistake,
    Question,
    check,
    check_kernel,
    poisoned,
    register,
    sandbox,
)
from course_lib.exercises.diagnose import diagnosed
from course_lib.exercises.flash_v2 import kernel_variant
from course_lib.iomodel import decode as io

# ============================================================================== lesson 11

#: Excerpts of the config.json of published checkpoints on the Hugging Face hub (the keys a KV
#: cache depends on, and a few that it does not). OPT-13B's has no num_key_value_heads: it
#: predates GQA, every query head has its own K/V head. Qwen3-4B and Gemma-2-2B give head_dim
#: beside hidden_size, and it is not hidden_size / num_attention_heads.
CONFIGS = {
    "meta-llama/Meta-Llama-3-8B": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "torch_dtype": "bfloat16", "vocab_size": 128256},
    "meta-llama/Llama-2-13b-hf": {
        "model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
        "max_position_embeddings": 4096, "num_attention_heads": 40, "num_hidden_layers": 40,
        "num_key_value_heads": 40, "torch_dtype": "float16", "vocab_size": 32000},
    "facebook/opt-13b": {
        "model_type": "opt", "hidden_size": 5120, "ffn_dim": 20480,
        "max_position_embeddings": 2048, "num_attention_heads": 40, "num_hidden_layers": 40,
        "torch_dtype": "float16", "vocab_size": 50272},
    "meta-llama/Llama-2-70b-hf": {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
        "max_position_embeddings": 4096, "num_attention_heads": 64, "num_hidden_layers": 80,
        "num_key_value_heads": 8, "torch_dtype": "float16", "vocab_size": 32000},
    "Qwen/Qwen3-4B": {
        "model_type": "qwen3", "hidden_size": 2560, "head_dim": 128, "intermediate_size": 9728,
        "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "torch_dtype": "bfloat16", "vocab_size": 151936},
    "google/gemma-2-2b": {
        "model_type": "gemma2", "hidden_size": 2304, "head_dim": 256, "intermediate_size": 9216,
        "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
        "num_key_value_heads": 4, "sliding_window": 4096, "torch_dtype": "float32",
        "vocab_size": 256000},
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
        "max_position_embeddings": 2048, "num_attention_heads": 32, "num_hidden_layers": 22,
        "num_key_value_heads": 4, "torch_dtype": "bfloat16", "vocab_size": 32000},
}


# --- what the notebook shows ----------------------------------------------------------------
def kv_cache_bytes(config, n_tokens, batch=1):
    # TODO: bytes of K and V for `batch` sequences of `n_tokens` tokens, from the config
    raise NotImplementedError


# --- the reference and the mistakes students make ------------------------------------------
def kv_cache_bytes_solution(config, n_tokens, batch=1):
    """Bytes of the KV cache of ``batch`` sequences of ``n_tokens`` tokens: every layer keeps a
    key and a value vector per token and K/V head, in the checkpoint's dtype."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    bytes_per_el = {"float32": 4, "float16": 2, "bfloat16": 2}[config["torch_dtype"]]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * bytes_per_el * n_tokens * batch


def _kv_parts(config):
    """(layers, K/V heads, query heads, head_dim, hidden_size / heads, bytes a number)."""
    heads = config["num_attention_heads"]
    derived = config["hidden_size"] // heads
    return (config["num_hidden_layers"], config.get("num_key_value_heads", heads), heads,
            config.get("head_dim") or derived, derived,
            {"float32": 4, "float16": 2, "bfloat16": 2}[config["torch_dtype"]])


def _kv_keys_only(config, n_tokens, batch=1):
    layers, kv_heads, _, head_dim, _, nbytes = _kv_parts(config)
    return layers * kv_heads * head_dim * nbytes * n_tokens * batch


def _kv_query_heads(config, n_tokens, batch=1):
    layers, _, heads, head_dim, _, nbytes = _kv_parts(config)
    return 2 * layers * heads * head_dim * nbytes * n_tokens * batch


def _kv_bits(config, n_tokens, batch=1):
    layers, kv_heads, _, head_dim, _, nbytes = _kv_parts(config)
    return 2 * layers * kv_heads * head_dim * (8 * nbytes) * n_tokens * batch


def _kv_derived_head_dim(config, n_tokens, batch=1):
    layers, kv_heads, _, _, derived, nbytes = _kv_parts(config)
    return 2 * layers * kv_heads * derived * nbytes * n_tokens * batch


def _kv_two_bytes(config, n_tokens, batch=1):
    layers, kv_heads, _, head_dim, _, _ = _kv_parts(config)
    return 2 * layers * kv_heads * head_dim * 2 * n_tokens * batch


def _kv_no_batch(config, n_tokens, batch=1):
    layers, kv_heads, _, head_dim, _, nbytes = _kv_parts(config)
    return 2 * layers * kv_heads * head_dim * nbytes * n_tokens


def _kv_requires_kv_heads(config, n_tokens, batch=1):
    layers, _, _, head_dim, _, nbytes = _kv_parts(config)
    return 2 * layers * config["num_key_value_heads"] * head_dim * nbytes * n_tokens * batch


_KV_CASES = [("meta-llama/Meta-Llama-3-8B", 8192, 1),
             ("meta-llama/Llama-2-13b-hf", 4096, 1),
             ("meta-llama/Llama-2-70b-hf", 4096, 8),
             ("Qwen/Qwen3-4B", 32768, 2),
             ("google/gemma-2-2b", 4096, 1),  # within its sliding window: every layer keeps all
             ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", 2048, 16),
             ("facebook/opt-13b", 2048, 4)]

#: The wrong formulas students write, and what a student is told when an answer agrees with
#: one of them on every case up to the first it gets wrong (the first mistake that shows).
_KV_SIGNATURES = (
    (_kv_keys_only, "half the expected bytes: the cache holds a key and a value vector per "
                    "token, layer and K/V head. The factor 2 for K and V is missing."),
    (_kv_bits, "8x the expected bytes: bits, not bytes (bfloat16 is 16 bits, 2 bytes a "
               "number)."),
    (_kv_query_heads, "too large by num_attention_heads / num_key_value_heads exactly (4x for "
                      "Llama-3-8B, 8x for Llama-2-70B): the query heads were counted, but the "
                      "cache stores only the K/V heads."),
    (_kv_derived_head_dim, "right until a config that gives head_dim: Qwen3-4B's heads are not "
                           "hidden_size / num_attention_heads = 80 wide, they are head_dim = "
                           "128 wide (Gemma-2-2B's 256, not 288)."),
    (_kv_two_bytes, "right until Gemma-2-2B, whose torch_dtype is float32: 4 bytes a number, "
                    "not 2. Read the size from the dtype."),
    (_kv_no_batch, "right for one sequence, off by the batch for several: each sequence has a "
                   "cache of its own."),
)


def _describe_kv(case):
    name, n_tokens, batch = case
    return f"{name}, {n_tokens} tokens, batch {batch}"


def _diagnose_kv(student, message: str) -> str | None:
    """The first registered mistake the student's answers agree with, case by case up to the
    first wrong one, in words."""
    if "KeyError" in message and "num_key_value_heads" in message:
        return ("facebook/opt-13b's config has no num_key_value_heads: it predates GQA, and "
                "without that key every query head has its own K/V head (multi-head "
                "attention). Fall back to num_attention_heads.")
    got = []
    for name, n_tokens, batch in _KV_CASES:
        try:
            got.append(float(student(CONFIGS[name], n_tokens, batch)))
        except Exception:  # the check's own message says which case raised
            break
    cases = _KV_CASES[:len(got)]
    right = [kv_cache_bytes_solution(CONFIGS[c], n, b) for c, n, b in cases]
    first = next((i for i, (g, w) in enumerate(zip(got, right)) if not np.isclose(g, w)), None)
    if first is None:
        return None
    for wrong, why in _KV_SIGNATURES:
        if np.allclose(got[:first + 1], [wrong(CONFIGS[c], n, b) for c, n, b in
                                         cases[:first + 1]], rtol=1e-9):
            return why
    return None


KV_HINTS = (
    "start from section 2's formula: which key of the config gives each of its factors? Two "
    "of them are not written in every config as such.",
    "the cache keeps K/V heads, not query heads. A config without num_key_value_heads "
    "(written before GQA) has one K/V head per query head.",
    "head_dim is in some configs; where it is not, a head is hidden_size / "
    "num_attention_heads wide. The bytes of a number follow from torch_dtype: bfloat16 and "
    "float16 are 16 bits.",
    "the formula counts one token of one sequence: multiply by the tokens and the sequences.",
)
KV_NUDGES = {"KeyError": KV_HINTS[1]}


def check_kv_cache_bytes(student, show: bool = True):
    """``student(config, n_tokens, batch) -> bytes`` of K and V, every layer."""
    def by_name(name, n_tokens, batch):
        return student(CONFIGS[name], n_tokens, batch)

    result = check("kv_cache_bytes", by_name,
                   lambda name, n, b: kv_cache_bytes_solution(CONFIGS[name], n, b),
                   _KV_CASES, show=False, describe=_describe_kv)
    return diagnosed("kv_cache_bytes", result, lambda msg: _diagnose_kv(student, msg),
                     KV_HINTS, KV_NUDGES, show)


register(Exercise(
    name="kv_cache_bytes", lesson="11_kv_cache_gqa", kind="python",
    writes="the KV cache of a real checkpoint from its config.json: head dim, K/V heads, dtype",
    lines=4, check=check_kv_cache_bytes, solution=kv_cache_bytes_solution, stub=kv_cache_bytes,
    mistakes=(Mistake("keys only: the factor 2 for K and V forgotten", _kv_keys_only,
                      "factor 2 for K and V"),
              Mistake("query heads instead of K/V heads", _kv_query_heads,
                      "query heads were counted"),
              Mistake("bits, not bytes", _kv_bits, "bits, not bytes"),
              Mistake("head_dim always hidden_size / num_attention_heads",
                      _kv_derived_head_dim, "a config that gives head_dim"),
              Mistake("2 bytes a number whatever the dtype", _kv_two_bytes, "float32"),
              Mistake("one sequence, whatever the batch", _kv_no_batch, "off by the batch"),
              Mistake("num_key_value_heads read from every config", _kv_requires_kv_heads,
                      "predates GQA")),
    hints=KV_HINTS))

_GQA4 = dict(B=1, H=32, H_kv=8, L=32768, D=128)  # section 4's GQA-4 row
_spec1 = io.decode_attention_io(N_q=1, **_GQA4)
_spec5 = io.decode_attention_io(N_q=5, **_GQA4)


def _ridge(key: str = "H100-SXM") -> float:
    from course_lib import hardware

    return hardware.get_gpu(key).ridge_point("fp16")


register(Question(
    name="q11_speculative", lesson="11_kv_cache_gqa",
    asks="Speculative decoding verifies N_q = 5 draft tokens in one step. What happens to the "
         "arithmetic intensity (GQA-4, L = 32k) and to the time of the step? When is attention "
         "compute-bound again?",
    answer=(
        f"The bytes hardly move: K and V are read once whatever N_q is "
        f"({_spec1['kv_bytes'] / 2**20:.0f} MiB for H_kv = 8, L = 32768, D = 128), and q and o "
        f"grow from {_spec1['qo_bytes'] / 1024:.0f} KiB to {_spec5['qo_bytes'] / 1024:.0f} KiB. "
        f"The FLOPs grow 5x (every cached key meets 5 queries per head). So the intensity goes "
        f"from {_spec1['intensity']:.2f} to {_spec5['intensity']:.2f} FLOP/byte (about G·N_q = "
        f"4·5 = 20), and the step's time stays at the memory floor: 5 tokens checked for the "
        f"price of one, which is why speculative decoding pays. Attention turns compute-bound "
        f"when G·N_q reaches the ridge point: {_ridge():.0f} FLOP/byte on an H100 in fp16, so "
        f"N_q ≈ {_ridge() / 4:.0f} with groups of 4 — the regime of prefill, where the kernels "
        f"of lessons 07–10 are the right tool."),
    value=_spec5["intensity"]))

_13b = io.MODELS["Llama-2-13B"]
_fp16_bytes = io.kv_bytes_per_token(_13b)
_int8_bytes = io.kv_bytes_per_token(_13b, bytes_per_el=1)

register(Question(
    name="q11_int8_cache", lesson="11_kv_cache_gqa",
    asks="Quantising the cache to 8 bits halves its bytes. Which numbers of the lesson change, "
         "and by how much? (Llama-2-13B's bytes per token with an 8-bit cache?)",
    answer=(
        f"Everything that counts cache bytes halves, everything that counts FLOPs stays. Bytes "
        f"per token: Llama-2-13B goes from {_fp16_bytes:,.0f} to {_int8_bytes:,.0f} bytes "
        f"({_int8_bytes / 1e6:.2f} MB). The cache of a conversation halves, and the tokens that "
        f"fit next to the weights double (the weights are not quantised here). A decode step "
        f"reads half the bytes for the same FLOPs: the intensity doubles (G·N_q becomes "
        f"2·G·N_q FLOP per byte), still far below the ridge point, so the step stays "
        f"memory-bound and its time floor halves. The programs, SMs and grid of section 5 do "
        f"not change. (The kernel must also dequantise: a little arithmetic it has to spare.)"),
    value=_int8_bytes))


# ============================================================================== lesson 12

# --- what the notebook shows: the NumPy merge -----------------------------------------------
def merge_partials(o_parts, lse_parts):
    # TODO: lse = log Σ e^{lse_s} (stably); weights e^{lse_s − lse}; o = Σ weights · o_s
    raise NotImplementedError


def merge_partials_solution(o_parts, lse_parts):
    """o_parts (S, D) normalised per split, lse_parts (S,) -> (o (D,), lse scalar)."""
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    used = np.isfinite(lse_parts)
    if not used.any():
        return np.zeros(o_parts.shape[-1]), -np.inf
    top = lse_parts[used].max()
    w = np.where(used, np.exp(np.where(used, lse_parts, top) - top), 0.0)
    total = w.sum()
    o = (w[:, None] * np.where(used[:, None], o_parts, 0.0)).sum(axis=0) / total
    return o, float(top + np.log(total))


def _merge_no_max(o_parts, lse_parts):
    with np.errstate(all="ignore"):
        w = np.exp(np.asarray(lse_parts, dtype=np.float64))
        return (w[:, None] * np.nan_to_num(o_parts)).sum(0) / w.sum(), float(np.log(w.sum()))


def _merge_nan_parts(o_parts, lse_parts):
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    top = np.max(lse_parts)
    with np.errstate(all="ignore"):
        w = np.exp(lse_parts - top)
        return (w[:, None] * o_parts).sum(0) / w.sum(), float(top + np.log(w.sum()))


def _merge_plain_mean(o_parts, lse_parts):
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    used = np.isfinite(lse_parts)
    top = lse_parts[used].max()
    return (np.asarray(o_parts)[used].mean(0),
            float(top + np.log(np.exp(lse_parts[used] - top).sum())))


def _split_case(rng, n, bounds, d=4, scale=1.0):
    """(o_parts, lse_parts) of one row of ``n`` scores cut at ``bounds``; an empty split gets
    lse = -inf and an o_s of NaN (whatever a buffer held: never to be read)."""
    s = rng.standard_normal(n) * scale
    v = rng.standard_normal((n, d))
    o_parts, lse_parts = [], []
    for lo, hi in bounds:
        if lo >= hi:
            o_parts.append(np.full(d, np.nan))
            lse_parts.append(-np.inf)
            continue
        p = np.exp(s[lo:hi] - s[lo:hi].max())
        o_parts.append(p @ v[lo:hi] / p.sum())
        lse_parts.append(s[lo:hi].max() + np.log(p.sum()))
    return np.array(o_parts), np.array(lse_parts)


def _merge_cases():
    rng = np.random.default_rng(12)
    return [_split_case(rng, 40, [(0, 10), (10, 25), (25, 40)]),
            _split_case(rng, 64, [(0, 64)]),
            _split_case(rng, 30, [(0, 16), (16, 30)], scale=300.0),  # e^lse overflows
            _split_case(rng, 20, [(0, 16), (16, 20), (32, 20)]),     # an empty split
            (np.full((2, 4), np.nan), np.array([-np.inf, -np.inf]))]  # every split empty


def _describe_merge(args):
    o_parts, lse_parts = args
    S = len(lse_parts)
    empty = int(np.isinf(lse_parts).sum())
    text = f"{S} split{'s' * (S > 1)}"
    if empty == S:
        return text + ", every split empty (a row that sees no key)"
    if empty:
        text += f", {empty} empty (lse_s = −inf, o_s = NaN)"
    top = np.max(lse_parts)
    if top > 80:
        text += f", lse_s up to {top:.0f}: e^lse_s overflows"
    return text


MERGE_HINTS = (
    "work relative to the largest lse_s of the row, as in lesson 01's safe softmax: every "
    "exponent is then ≤ 0 and no exponential overflows.",
    "each split's weight is its share of the row's softmax mass: e^lse_s is the sum of the "
    "split's e^s_j, so what fraction of the whole row's sum is it? The weights of the used "
    "splits add up to 1.",
    "an empty split has lse_s = −inf and an o_s that may be anything, even NaN: 0 · NaN is NaN, "
    "so select (np.where) instead of multiplying by a zero weight. When every split is empty "
    "the row saw no key: o is zeros and lse is −inf.",
)
MERGE_NUDGES = {
    "every split empty": MERGE_HINTS[2],
    "empty (lse_s": MERGE_HINTS[2],
    "overflows": MERGE_HINTS[0],
    "values differ": "finite but wrong numbers: does each o_s count in proportion to its "
                     "split's share of the softmax mass, and do those shares add up to 1?",
}


def check_merge_partials(student, show: bool = True):
    """``student(o_parts, lse_parts) -> (o, lse)``: merge the splits of one query row."""
    return check("merge_partials", student, merge_partials_solution, _merge_cases(),
                 hints=MERGE_HINTS, nudges=MERGE_NUDGES, rtol=1e-9, atol=1e-12, show=show,
                 describe=_describe_merge)


register(Exercise(
    name="merge_partials", lesson="12_flash_decoding", kind="python",
    writes="Flash-Decoding's merge of (o_s, lse_s) for one query row, in NumPy", lines=6,
    check=check_merge_partials, solution=merge_partials_solution, stub=merge_partials,
    mistakes=(Mistake("e^lse_s without subtracting the max", _merge_no_max, "overflows"),
              Mistake("an empty split's NaN o_s times a zero weight", _merge_nan_parts, "NaN"),
              Mistake("the mean of the o_s, no weights", _merge_plain_mean, "values differ")),
    hints=MERGE_HINTS))


# --- what the notebook shows: the merge kernel ----------------------------------------------
@triton.jit
def merge_kernel(O_PART, LSE_PART, OUT, LSE_OUT, S, D,
                 BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # one query row; its splits are O_PART[row] (S, D), LSE_PART[row]
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    # pass 1: every split's lse_s (an empty split holds -inf)
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(LSE_PART + row * S + offs_s, mask=offs_s < S, other=float("-inf"))
    lse_max = ...  # TODO: the largest lse_s of the row
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: no -inf
    # pass 2: add up the weighted o_s, CHUNK splits at a time
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([CHUNK], tl.float32)
    for s0 in range(0, S, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)
        lse_s = tl.load(LSE_PART + row * S + offs_c, mask=offs_c < S, other=float("-inf"))
        used = ...  # TODO: True for the splits of this chunk that hold keys
        w = ...  # TODO: each split's weight relative to lse_max (exactly 0 where not used)
        o_mask = ...  # TODO: the (split, d) elements of o_s to read; never an empty split's
        o_s = tl.load(O_PART + (row * S + offs_c)[:, None] * D + offs_d[None, :],
                      mask=o_mask, other=0.0)  # (CHUNK, BLOCK_D)
        acc = ...  # TODO: add this chunk's weighted o_s
        denom = ...  # TODO: add this chunk's weights
    total = tl.sum(denom, 0)
    has_keys = total > 0.0  # False for a row whose splits are all empty
    total_safe = tl.where(has_keys, total, 1.0)
    o = ...  # TODO: the merged output (zeros for a row without keys)
    lse = ...  # TODO: the row's log-sum-exp (-inf for a row without keys)
    tl.store(OUT + row * D + offs_d, o, mask=d_ok)
    tl.store(LSE_OUT + row, lse)


# --- the reference and the mistakes students make ------------------------------------------
@triton.jit
def _merge_kernel_solution(O_PART, LSE_PART, OUT, LSE_OUT, S, D,
                           BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # one query row; its splits are O_PART[row] (S, D), LSE_PART[row]
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    # pass 1: every split's lse_s (an empty split holds -inf)
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(LSE_PART + row * S + offs_s, mask=offs_s < S, other=float("-inf"))
    lse_max = tl.max(lse_all, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: no -inf
    # pass 2: add up the weighted o_s, CHUNK splits at a time
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([CHUNK], tl.float32)
    for s0 in range(0, S, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)
        lse_s = tl.load(LSE_PART + row * S + offs_c, mask=offs_c < S, other=float("-inf"))
        used = lse_s > float("-inf")
        w = tl.where(used, tl.exp(lse_s - lse_max), 0.0)
        o_mask = used[:, None] & d_ok[None, :]
        o_s = tl.load(O_PART + (row * S + offs_c)[:, None] * D + offs_d[None, :],
                      mask=o_mask, other=0.0)  # (CHUNK, BLOCK_D)
        acc = acc + tl.sum(o_s * w[:, None], 0)
        denom = denom + w
    total = tl.sum(denom, 0)
    has_keys = total > 0.0  # False for a row whose splits are all empty
    total_safe = tl.where(has_keys, total, 1.0)
    o = acc / total_safe
    lse = tl.where(has_keys, lse_max + tl.log(total_safe), float("-inf"))
    tl.store(OUT + row * D + offs_d, o, mask=d_ok)
    tl.store(LSE_OUT + row, lse)


_W_LINE = "w = tl.where(used, tl.exp(lse_s - lse_max), 0.0)"
_LSE_LINE = 'lse = tl.where(has_keys, lse_max + tl.log(total_safe), float("-inf"))'
_O_MASK_LINE = "o_mask = used[:, None] & d_ok[None, :]"
_merge_kernel_no_max = kernel_variant(  # e^lse_s: inf once lse_s > 88 in fp32
    _merge_kernel_solution, (_W_LINE, "w = tl.where(used, tl.exp(lse_s), 0.0)"),
    (_LSE_LINE, 'lse = tl.where(has_keys, tl.log(total_safe), float("-inf"))'))
_merge_kernel_reads_empty = kernel_variant(  # the empty splits' o_s too: 0 · NaN = NaN
    _merge_kernel_solution, (_O_MASK_LINE, "o_mask = (offs_c < S)[:, None] & d_ok[None, :]"))
_merge_kernel_no_d_mask = kernel_variant(  # BLOCK_D > D reads past the last row
    _merge_kernel_solution, (_O_MASK_LINE, "o_mask = used[:, None]"))
_merge_kernel_exp2 = kernel_variant(  # the lse_s are natural logs
    _merge_kernel_solution, (_W_LINE, "w = tl.where(used, tl.math.exp2(lse_s - lse_max), 0.0)"),
    (_LSE_LINE, 'lse = tl.where(has_keys, lse_max + tl.math.log2(total_safe), float("-inf"))'))


def _merge_in_torch(o_part, lse_part):
    w = torch.softmax(lse_part, dim=-1)
    return (w[..., None] * o_part.nan_to_num()).sum(-2), torch.logsumexp(lse_part, -1)


# --- the checker -----------------------------------------------------------------------------
MERGE_CHUNK = 4


def _row_bounds(rng, n_keys, S, empty_at=()):
    """Cut ``n_keys`` keys into S runs (some empty): the splits of one query row."""
    cuts = np.sort(rng.choice(np.arange(1, n_keys), size=S - 1 - len(empty_at), replace=False))
    edges = [0, *cuts.tolist(), n_keys]
    runs = [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]
    for s in sorted(empty_at):
        runs.insert(s, (0, 0))
    return runs


def _merge_batch(seed, S, D, rows, scale=1.0):
    """(o_part (R, S, D), lse_part (R, S)) fp32 for a list of rows, each ``None`` (every split
    empty) or a tuple of the indices of its empty splits."""
    rng = np.random.default_rng(seed)
    o_all, lse_all = [], []
    for empty_at in rows:
        if empty_at is None:
            o_all.append(np.full((S, D), np.nan))
            lse_all.append(np.full(S, -np.inf))
            continue
        n = int(rng.integers(3 * S, 6 * S))
        o, lse = _split_case(rng, n, _row_bounds(rng, n, S, empty_at), d=D, scale=scale)
        o_all.append(o)
        lse_all.append(lse)
    return (torch.tensor(np.array(o_all), dtype=torch.float32),
            torch.tensor(np.array(lse_all), dtype=torch.float32))


def _merge_kernel_cases():
    return [
        (*_merge_batch(0, 4, 16, [(), (), ()]), "3 rows, 4 splits, D = 16"),
        (*_merge_batch(1, 5, 20, [(3, 4), (1,), None, ()]),
         "4 rows, S = 5, D = 20: empty splits (lse_s = −inf, o_s = NaN), a row with every "
         "split empty"),
        (*_merge_batch(2, 3, 8, [(), (2,)], scale=300.0),
         "2 rows, 3 splits, D = 8, scores × 300: lse_s in the hundreds, e^lse_s overflows "
         "fp32"),
        (*_merge_batch(3, 13, 40, [(0, 5, 12), ()]),
         "2 rows, S = 13 (4 chunks, the last one partial), D = 40"),
    ]


def prepare_merge(o_part, lse_part, label=""):
    """One launch: one program per query row; o and lse poisoned."""
    R, S, D = o_part.shape
    out = poisoned(R, D, like=o_part)
    lse = poisoned(R, like=lse_part)
    args = dict(O_PART=o_part, LSE_PART=lse_part, OUT=out, LSE_OUT=lse, S=S, D=D,
                BLOCK_S=triton.next_power_of_2(S), CHUNK=MERGE_CHUNK,
                BLOCK_D=triton.next_power_of_2(D))
    return (R,), args, (out, lse)


def _merge_spec(o_part, lse_part, label=""):
    o_np = o_part.detach().cpu().double().numpy()
    lse_np = lse_part.detach().cpu().double().numpy()
    merged = [merge_partials_solution(o_np[r], lse_np[r]) for r in range(len(lse_np))]
    return (torch.tensor(np.array([m[0] for m in merged])),
            torch.tensor([m[1] for m in merged], dtype=torch.float64))


MERGE_KERNEL_HINTS = (
    "the lesson's merge for one row: pass 1 finds the largest lse_s, pass 2 weighs every split "
    "relative to it, so that no exponential sees a large positive number.",
    "an empty split is marked by lse_s = −inf: it weighs exactly 0 (tl.where), and its o_s "
    "must not even be loaded, since 0 · NaN is NaN. A load's mask decides what is read; "
    "other=0.0 fills the rest.",
    "the mask of the o_s load is 2-D, (CHUNK, BLOCK_D): a split that holds keys, and a "
    "column inside the head dim D (BLOCK_D is a power of two, D need not be). Broadcast two "
    "1-D masks with [:, None] and [None, :].",
    "acc and denom are running sums over the chunks: of what, in section 1's merge? "
    "tl.sum(x, 0) adds up the rows of a (CHUNK, BLOCK_D) block. At the end, remember that "
    "every weight was taken relative to lse_max: what must o be divided by, and what does "
    "the total say about the row's lse?",
)
MERGE_KERNEL_NUDGES = {
    "NaN: never written": "a NaN where a number belongs: an exponential that overflowed "
                          "(inf / inf), an empty split's o_s multiplied by its weight 0 "
                          "(0 · NaN = NaN), or an element never stored. The case's "
                          "description says what is special about it.",
    "values differ": "finite but wrong numbers: are all weights taken relative to the same "
                     "lse_max, in the base the partials were stored in (natural logs: e^x, "
                     "not 2^x), and does the lse use the same base?",
}


def check_merge_kernel(kernel, show: bool = True):
    """``kernel``: your ``@triton.jit`` merge kernel; one program per query row."""
    return check_kernel("merge_kernel", kernel, prepare_merge, _merge_spec,
                        _merge_kernel_cases(), hints=MERGE_KERNEL_HINTS,
                        nudges=MERGE_KERNEL_NUDGES, show=show, rtol=1e-5, atol=1e-6,
                        describe=lambda c: c[-1])


register(Exercise(
    name="merge_kernel", lesson="12_flash_decoding", kind="triton",
    writes="the stable merge of the split-KV partials: max, weights, masked read, sums",
    lines=8, check=check_merge_kernel, solution=_merge_kernel_solution, stub=merge_kernel,
    extra=(prepare_merge,),
    mistakes=(Mistake("e^lse_s without subtracting the max", _merge_kernel_no_max,
                      "overflows fp32"),
              Mistake("empty splits' NaN o_s read into the sum", _merge_kernel_reads_empty,
                      "NaN"),
              Mistake("the o_s load without its mask on d", _merge_kernel_no_d_mask,
                      "tl.load out of bounds"),
              Mistake("exp2 (and log2) on natural-log lse_s", _merge_kernel_exp2,
                      "values differ"),
              Mistake("an answer in PyTorch, no kernel", _merge_in_torch,
                      "@triton.jit kernel")),
    hints=MERGE_KERNEL_HINTS))


# --- think-questions ------------------------------------------------------------------------
_Q12_ROWS, _Q12_SPLITS, _Q12_D = 1 * 32 * 1, 64, 128  # B · H · N_q rows, 64 splits, D = 128
_q12_o_bytes = _Q12_ROWS * _Q12_SPLITS * _Q12_D * 4
_q12_lse_bytes = _Q12_ROWS * _Q12_SPLITS * 4
_q12_parts = _q12_o_bytes + _q12_lse_bytes
_kv128k = io.decode_attention_io(B=1, H=32, H_kv=8, N_q=1, L=131072, D=128)["kv_bytes"]
_kv4k = io.decode_attention_io(B=1, H=32, H_kv=8, N_q=1, L=4096, D=128)["kv_bytes"]

register(Question(
    name="q12_partials_bytes", lesson="12_flash_decoding",
    asks="B = 1, H = 32, D = 128, 64 splits: how many bytes of partial results does the split "
         "kernel write (and the merge read), against K and V at N = 128k and at N = 4k?",
    answer=(
        f"One (o_s, lse_s) per query row and split, in fp32: {_Q12_ROWS} rows × "
        f"{_Q12_SPLITS} splits × ({_Q12_D} + 1) × 4 bytes = {_q12_parts:,} bytes "
        f"({_q12_o_bytes / 2**20:.0f} MiB of o_s, {_q12_lse_bytes // 1024} KiB of lse_s), "
        f"written once and read once. K and V at N = 128k (H_kv = 8, fp16) are "
        f"{_kv128k / 2**20:.0f} MiB: the partials add {2 * _q12_parts / _kv128k:.2%} of "
        f"traffic (write + read). At N = 4k, K and V are {_kv4k / 2**20:.0f} MiB and the same "
        f"partials add {2 * _q12_parts / _kv4k:.1%}: with 64 splits each split holds only 64 "
        f"keys, a sliver. That is one reason choose_num_splits takes fewer splits for short "
        f"caches: the merge's share of the traffic shows at 4k and vanishes at 128k."),
    value=_q12_parts))

register(Question(
    name="q12_padded_rows", lesson="12_flash_decoding",
    asks="G = 4, N_q = 1: 4 real rows of tl.dot padded to 16. Why does the waste not matter, "
         "and from which G · N_q on would the kernel stop being memory-bound (H100, fp16)?",
    answer=(
        f"The kernel's time is the time to stream K and V from HBM. Per K/V tile it does "
        f"4·BLOCK_M·BLOCK_N·D FLOPs on tensor cores that would otherwise wait for the next "
        f"tile: even counting the 12 padded rows, 16 rows on 4 bytes per key and dim (K and V "
        f"in fp16) is 16 FLOP per byte, far below the ridge point. Wasted tensor-core work is "
        f"free while the loads are the bottleneck. The real intensity is about G·N_q FLOP per "
        f"byte (lesson 11); the kernel turns compute-bound when G·N_q reaches the ridge point, "
        f"{_ridge():.0f} FLOP/byte on an H100 SXM in fp16 (the H200 has the same FLOPs and "
        f"more bandwidth: {_ridge('H200'):.0f}). Long before that, past 64 rows (the cap of "
        f"BLOCK_M) the kernel runs several m-tiles (its third grid dimension), each reading "
        f"K and V again: the design assumes a few rows."),
    value=_ridge(), rtol=0.05))


# ============================================================================== lesson 13

# --- what the notebook shows: a block-table lookup ------------------------------------------
def physical_slot(block_table_row, position, block_size=16):
    # TODO: logical block and offset, then the table
    raise NotImplementedError


def physical_slot_solution(block_table_row, position, block_size=16):
    j, offset = divmod(int(position), int(block_size))
    return int(block_table_row[j]), offset


def _slot_swapped(block_table_row, position, block_size=16):
    return int(block_table_row[position % block_size]), position // block_size


def _slot_no_table(block_table_row, position, block_size=16):
    return position // block_size, position % block_size


def _slot_off_by_one(block_table_row, position, block_size=16):
    j = -(-position // block_size)  # rounds up: position 15 lands in block 1
    return int(block_table_row[j]), position % block_size


SLOT_HINTS = (
    "two steps: which logical block of the sequence holds the token, and where inside that "
    "block; then the table turns the logical block into a physical one.",
    "logical block j holds the positions j·block_size … j·block_size + block_size − 1: given "
    "a position, how do you find j, and how far into block j the token lies?",
    "index the table row with the logical block (never with the position); the offset is the "
    "same in the physical block, since blocks are moved whole.",
)
SLOT_NUDGES = {"IndexError": "an index past the end of the table row: the row has one entry "
                             "per block, not one per token."}


def check_physical_slot(student, show: bool = True):
    """``student(block_table_row, position, block_size) -> (block, offset)``."""
    row = [7, 2, 9, 4]
    cases = [(row, 0, 16), (row, 15, 16), (row, 16, 16), (row, 63, 16), (row, 37, 16),
             ([3, 1, 0], 5, 2)]
    return check("physical_slot", student, physical_slot_solution, cases, hints=SLOT_HINTS,
                 nudges=SLOT_NUDGES, show=show,
                 describe=lambda c: f"table row {c[0]}, position {c[1]}, block_size {c[2]}")


register(Exercise(
    name="physical_slot", lesson="13_paged_attention", kind="python",
    writes="a block-table lookup: logical position -> (physical block, offset)", lines=2,
    check=check_physical_slot, solution=physical_slot_solution, stub=physical_slot,
    mistakes=(Mistake("% and // swapped", _slot_swapped, "IndexError"),
              Mistake("no table: logical taken for physical", _slot_no_table, "values differ"),
              Mistake("the block rounded up", _slot_off_by_one, "values differ")),
    hints=SLOT_HINTS))


# --- what the notebook shows: the paged gather kernel ---------------------------------------
@triton.jit
def paged_gather_kernel(K_PAGES, BLOCK_TABLE, SEQLENS, OUT,
                        stride_pb, stride_ps, stride_ph, stride_tb, H_KV, N_MAX,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
    bg = tl.program_id(0)  # b * H_KV + g: sequence b, K/V head g
    b = bg // H_KV
    g = bg % H_KV
    offs_d = tl.arange(0, HEAD_DIM)
    seqlen = tl.load(SEQLENS + b)
    table_row = BLOCK_TABLE + b * stride_tb  # entry j: the physical block of logical block j
    k_head = K_PAGES + g * stride_ph  # head g's part of every block of the pool
    out_head = OUT + bg * N_MAX * HEAD_DIM  # out[b, g]: row n at out_head + n * HEAD_DIM
    for start_n in range(0, N_MAX, BLOCK_N):
        ...  # TODO: the loop body: this tile's keys, their rows through the table, the copy


# --- the reference and the mistakes students make ------------------------------------------
@triton.jit
def _paged_gather_solution(K_PAGES, BLOCK_TABLE, SEQLENS, OUT,
                           stride_pb, stride_ps, stride_ph, stride_tb, H_KV, N_MAX,
                           BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    bg = tl.program_id(0)  # b * H_KV + g: sequence b, K/V head g
    b = bg // H_KV
    g = bg % H_KV
    offs_d = tl.arange(0, HEAD_DIM)
    seqlen = tl.load(SEQLENS + b)
    table_row = BLOCK_TABLE + b * stride_tb  # entry j: the physical block of logical block j
    k_head = K_PAGES + g * stride_ph  # head g's part of every block of the pool
    out_head = OUT + bg * N_MAX * HEAD_DIM  # out[b, g]: row n at out_head + n * HEAD_DIM
    for start_n in range(0, N_MAX, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # logical key positions
        n_ok = offs_n < seqlen  # past the length: no table entry to read, zeros written
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = offs_n % BLOCK_SIZE
        rows = block * stride_pb + slot * stride_ps
        k = tl.load(k_head + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        tl.store(out_head + offs_n[:, None] * HEAD_DIM + offs_d[None, :], k,
                 mask=(offs_n < N_MAX)[:, None])


_GATHER_WRONG = {
    "swapped": kernel_variant(_paged_gather_solution,
                              ("offs_n // BLOCK_SIZE, mask", "offs_n % BLOCK_SIZE, mask"),
                              ("slot = offs_n % BLOCK_SIZE", "slot = offs_n // BLOCK_SIZE")),
    "no_table": kernel_variant(_paged_gather_solution, (
        "block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)",
        "block = offs_n // BLOCK_SIZE")),
    "k_unmasked": kernel_variant(_paged_gather_solution, (
        "mask=n_ok[:, None], other=0.0)", ")")),
    "table_unmasked": kernel_variant(_paged_gather_solution, (
        "offs_n // BLOCK_SIZE, mask=n_ok, other=0)", "offs_n // BLOCK_SIZE)")),
    "store_unmasked": kernel_variant(_paged_gather_solution, (
        "k,\n                 mask=(offs_n < N_MAX)[:, None])", "k)")),
    "no_strides": kernel_variant(_paged_gather_solution, (
        "rows = block * stride_pb + slot * stride_ps",
        "rows = (block * BLOCK_SIZE + slot) * HEAD_DIM")),
}


def _gather_in_torch(k_pages, block_table, seqlens, n_max, label=""):
    from course_lib.kvcache import pages_to_contiguous

    return pages_to_contiguous(k_pages, block_table, seqlens, n_max)


# --- the checker -----------------------------------------------------------------------------
GATHER_BLOCK_N = 8


def _scattered(seed, lens, H_kv, D, block_size, num_blocks):
    """A cache of ``lens`` keys per sequence scattered into pages in a random order."""
    from course_lib.kvcache import contiguous_to_pages

    gen = torch.Generator().manual_seed(seed)
    n_max = max(lens)
    k = torch.randn(len(lens), H_kv, n_max, D, generator=gen)
    pages, table = contiguous_to_pages(k.cpu(), block_size=block_size, num_blocks=num_blocks,
                                       generator=gen)
    pages = torch.randn(pages.shape, generator=gen) * (pages == 0) + pages  # no zero slots
    return pages.cpu(), table.cpu(), torch.tensor(lens, dtype=torch.int32), n_max


def _forked(seed, H_kv=2, D=16, block_size=4):
    """Two samples forked from a 6-token prompt: block 0 of the prompt is shared by both
    tables, the partial block 1 copied on write; blocks interleave in the pool."""
    from course_lib.kvcache import PagedKVCache

    gen = torch.Generator().manual_seed(seed)
    pool = PagedKVCache(num_blocks=12, block_size=block_size, num_kv_heads=H_kv, head_dim=D,
                        dtype=torch.float32, device="cpu")
    pool.k_pages.copy_(torch.randn(pool.k_pages.shape, generator=gen))  # free slots: garbage
    pool.add_sequence("prompt")
    pool.extend("prompt", torch.randn(6, H_kv, D, generator=gen),
                torch.randn(6, H_kv, D, generator=gen))
    pool.fork("prompt", "a")
    pool.fork("prompt", "b")
    pool.free("prompt")
    for seq, n in (("a", 3), ("b", 2), ("a", 4), ("b", 5)):  # they grow in turns
        pool.extend(seq, torch.randn(n, H_kv, D, generator=gen),
                    torch.randn(n, H_kv, D, generator=gen))
    table = pool.block_table(["a", "b"]).cpu()  # entries past a sequence's last block: -1
    lens = pool.seqlens(["a", "b"]).cpu()
    return pool.k_pages, table, lens, int(lens.max())


def _gather_cases():
    return [
        (*_scattered(0, [16, 11], 1, 16, 4, 10),
         "2 sequences of 16 and 11 keys, 1 head, pages of 4 in a random order"),
        (*_scattered(1, [9, 1, 6, 0], 2, 16, 4, 16),
         "4 sequences of 9, 1, 6 and 0 keys, 2 heads, pages of 4: last blocks partly "
         "filled, tiles of 8 past a sequence's end and past N_MAX = 9"),
        (*_forked(2), "2 samples forked from a 6-token prompt: a block shared by both "
                      "tables, a copied one, blocks interleaved in the pool, -1 in the "
                      "table past each sequence's last block"),
    ]


def prepare_paged_gather(k_pages, block_table, seqlens, n_max, label=""):
    """One launch: one program per (sequence, K/V head); out poisoned."""
    num_blocks, block_size, H_kv, D = k_pages.shape
    B = block_table.shape[0]
    out = poisoned(B, H_kv, n_max, D, like=k_pages)
    args = dict(K_PAGES=k_pages, BLOCK_TABLE=block_table, SEQLENS=seqlens, OUT=out,
                stride_pb=k_pages.stride(0), stride_ps=k_pages.stride(1),
                stride_ph=k_pages.stride(2), stride_tb=block_table.stride(0), H_KV=H_kv,
                N_MAX=n_max, BLOCK_SIZE=block_size, BLOCK_N=GATHER_BLOCK_N, HEAD_DIM=D)
    return (B * H_kv,), args, out


def _gather_spec(k_pages, block_table, seqlens, n_max, label=""):
    from course_lib.kvcache import pages_to_contiguous

    return pages_to_contiguous(k_pages, block_table, seqlens, n_max)


def _gather_model(k_pages, block_table, seqlens, n_max, mistake):
    """out as a kernel with ``mistake`` computes it: "swapped" (block and slot), "no_table"
    (the logical block taken for the physical one) or "no_strides" (rows counted as if the pool
    held one head); None where that kernel would read outside the pool."""
    num_blocks, bs, H_kv, D = k_pages.shape
    flat = k_pages.reshape(-1)
    out = torch.zeros(block_table.shape[0], H_kv, n_max, D, dtype=k_pages.dtype)
    for b, n_b in enumerate(seqlens.tolist()):
        for n in range(n_b):
            j, slot = divmod(n, bs)
            if mistake == "swapped":
                j, slot = slot, j
            if j >= block_table.shape[1]:
                return None
            block = j if mistake == "no_table" else int(block_table[b, j])
            for g in range(H_kv):
                start = (g * k_pages.stride(2) + block * k_pages.stride(0)
                         + slot * k_pages.stride(1))
                if mistake == "no_strides":
                    start = g * k_pages.stride(2) + (block * bs + slot) * D
                if not 0 <= start <= flat.numel() - D:
                    return None
                out[b, g, n] = flat[start:start + D]
    return out


_GATHER_LOOKS_LIKE = {
    "swapped": "out is what a kernel reads with block and slot swapped: the table was indexed "
               "by the key's position inside its block, and the block number used as the slot.",
    "no_table": "out is what a kernel reads when the logical block is taken for the physical "
                "one: the block table was never read, but the pages lie in a random order.",
    "no_strides": "out is what a kernel reads when it counts rows as if the pool held one head "
                  "(block·BLOCK_SIZE + slot rows of HEAD_DIM): the pool is (num_blocks, "
                  "BLOCK_SIZE, H_kv, D), so a block is stride_pb elements and a slot "
                  "stride_ps.",
}


def _diagnose_gather(kernel, message: str) -> str | None:
    """Run the cases again in the interpreter and match the first wrong one's output."""
    if "out of bounds" in message or "raised" in message:
        return None
    for case in _gather_cases():
        grid, args, out = prepare_paged_gather(*case)
        tensors = {n: t for n, t in args.items() if isinstance(t, torch.Tensor)}
        try:
            if sandbox.run(kernel, grid, args, tensors):
                return None
        except Exception:  # the check's message already says what the kernel raised
            return None
        want = _gather_spec(*case)
        if torch.equal(out, want):
            continue
        lens = case[2].tolist()
        inside = torch.zeros(out.shape[:3], dtype=torch.bool)  # (b, g, n) with n < length
        for b, n_b in enumerate(lens):
            inside[b, :, :n_b] = True
        if torch.equal(out[inside], want[inside]) and not torch.isnan(out).any():
            return ("every key before a sequence's length is right, but the rows past it are "
                    "not zeros: past the length the kernel copied whatever the pool holds "
                    "there. Mask the load of K with the keys that exist (other=0.0).")
        for mistake, why in _GATHER_LOOKS_LIKE.items():
            model = _gather_model(*case[:4], mistake)
            if model is not None and torch.equal(out[inside], model[inside]):
                return why
        return None
    return None


GATHER_HINTS = (
    "follow one key n of sequence b: which logical block of the sequence holds it, which "
    "physical block that is (row b of the table says), and which slot inside the block.",
    "a tile is BLOCK_N keys from start_n on; the ones at or past the sequence's length do not "
    "exist. Logical block j holds keys j·BLOCK_SIZE … j·BLOCK_SIZE + BLOCK_SIZE − 1: a tile "
    "reads a vector of table entries with one tl.load.",
    "keys past the length have no table entry to read (a table row ends at the sequence's "
    "last block, and the last row ends the tensor): mask the table load like the K load.",
    "in the pool (num_blocks, BLOCK_SIZE, H_kv, D), the next block is stride_pb elements on "
    "and the next slot stride_ps: how far from k_head is the row of a key? Then copy the "
    "(BLOCK_N, HEAD_DIM) tile to its rows of out, the rows past N_MAX left alone.",
)
GATHER_NUDGES = {
    "of BLOCK_TABLE": GATHER_HINTS[2],
    "values differ": "your kernel reads real keys, but not the right ones: is the table row "
                     "indexed by the logical block (not the slot), is its entry used as the "
                     "block (not the logical block itself), and are block and slot turned "
                     "into a position with the pool's strides?",
}


def check_paged_gather(kernel, show: bool = True):
    """``kernel``: your ``@triton.jit`` paged gather: out[b, g, n] = key n of sequence b."""
    result = check_kernel("paged_gather", kernel, prepare_paged_gather, _gather_spec,
                          _gather_cases(), show=False, rtol=0.0, atol=0.0,
                          describe=lambda c: c[-1])
    return diagnosed("paged_gather", result, lambda msg: _diagnose_gather(kernel, msg),
                     GATHER_HINTS, {**GATHER_NUDGES, **KERNEL_NUDGES}, show)


register(Exercise(
    name="paged_gather", lesson="13_paged_attention", kind="triton",
    writes="the loop body of a paged read: each key's physical block and slot through the "
           "block table, its row in the pool, the masks, the copy",
    lines=7, check=check_paged_gather, solution=_paged_gather_solution,
    stub=paged_gather_kernel, extra=(prepare_paged_gather,),
    mistakes=(Mistake("block and slot swapped", _GATHER_WRONG["swapped"],
                      "block and slot swapped"),
              Mistake("no table: the logical block taken for the physical one",
                      _GATHER_WRONG["no_table"], "block table was never read"),
              Mistake("the K load without its mask: past the length, not zeros",
                      _GATHER_WRONG["k_unmasked"], "rows past it are not zeros"),
              Mistake("the table read without its mask", _GATHER_WRONG["table_unmasked"],
                      "tl.load out of bounds"),
              Mistake("the store without its mask", _GATHER_WRONG["store_unmasked"],
                      "tl.store out of bounds"),
              Mistake("rows counted as if the pool held one head", _GATHER_WRONG["no_strides"],
                      "as if the pool held one head"),
              Mistake("an answer in PyTorch, no kernel", _gather_in_torch,
                      "@triton.jit kernel")),
    hints=GATHER_HINTS))


# --- what the notebook shows: blocks with a shared prompt -----------------------------------
def shared_blocks(prompt_len, output_lens, block_size=16):
    # TODO: the prompt once, each sample's own blocks, and the copies of the partial block
    raise NotImplementedError


def shared_blocks_solution(prompt_len, output_lens, block_size=16):
    """Physical blocks used by len(output_lens) samples sharing a prompt of prompt_len tokens."""
    full, partial = divmod(prompt_len, block_size)
    blocks = full + (1 if partial else 0)  # the prompt, once
    for out in output_lens:
        total = prompt_len + out
        blocks += math.ceil(total / block_size) - full - (1 if partial else 0)
    if partial:  # a sample writing into the shared partial block copies it while others
        writers = sum(1 for out in output_lens if out > 0)  # still hold it: all writers but
        blocks += min(writers, len(output_lens) - 1)         # the last sample, if it writes
    return blocks


def _shared_no_cow(prompt_len, output_lens, block_size=16):
    blocks = math.ceil(prompt_len / block_size)
    for out in output_lens:
        blocks += math.ceil((prompt_len + out) / block_size) - math.ceil(prompt_len / block_size)
    return blocks


def _shared_every_writer_copies(prompt_len, output_lens, block_size=16):
    blocks = _shared_no_cow(prompt_len, output_lens, block_size)
    if prompt_len % block_size:
        blocks += sum(1 for out in output_lens if out > 0)
    return blocks


def _shared_nothing(prompt_len, output_lens, block_size=16):
    return sum(math.ceil((prompt_len + out) / block_size) for out in output_lens)


SHARED_HINTS = (
    "start from the fork: every sample's table points at the prompt's blocks, which are "
    "stored once. Then let the samples write, one after the other.",
    "a sample that writes past the prompt's last block needs new blocks of its own; count "
    "them from its final length and the prompt's blocks it already has.",
    "a full block is never written again and stays shared. A partly filled last block is "
    "written by every sample that generates a token: writing into a block that another "
    "sample still references means copying it first (copy-on-write). Who is left holding "
    "the original when the others have copied?",
)


def check_shared_blocks(student, show: bool = True):
    """``student(prompt_len, output_lens, block_size) -> blocks in use``."""
    cases = [(32, [10, 10], 16),        # the prompt fills its blocks: nothing to copy
             (100, [50, 50, 50, 50], 16),
             (20, [1, 1, 1], 16),
             (5, [30], 16),
             (64, [0, 16], 16)]
    return check("shared_blocks", student, shared_blocks_solution, cases, hints=SHARED_HINTS,
                 show=show, describe=lambda c: (f"prompt {c[0]} tokens, outputs {c[1]}, "
                                                f"blocks of {c[2]}"))


register(Exercise(
    name="shared_blocks", lesson="13_paged_attention", kind="python",
    writes="physical blocks of parallel samples sharing a prompt, with copy-on-write", lines=8,
    check=check_shared_blocks, solution=shared_blocks_solution, stub=shared_blocks,
    mistakes=(Mistake("no copy-on-write copies", _shared_no_cow, "values differ"),
              Mistake("every writer copies, the last one too", _shared_every_writer_copies,
                      "values differ"),
              Mistake("no sharing: the prompt stored per sample", _shared_nothing,
                      "values differ")),
    hints=SHARED_HINTS))


# --- think-question -------------------------------------------------------------------------
_Q13_WASTE_256 = 0.2056  # simulate_serving("paged", Workload(), block_size=256).waste: 1 s
_Q13_WASTE_16 = 0.0152   # ... block_size=16 (computed in the notebook; too slow for import)

register(Question(
    name="q13_block_size", lesson="13_paged_attention",
    asks="vLLM uses blocks of 16 tokens. What would blocks of 1 token cost the kernel, and "
         "blocks of 256 the allocator? (Fraction wasted with block_size=256?)",
    answer=(
        "Blocks of 1 token: the kernel reads one table entry per key instead of one per 16, "
        "and every key's row is its own page: a tile of BLOCK_N keys becomes BLOCK_N "
        "scattered gathers, each only D·2 bytes long (256 bytes for D = 128), and its table "
        "loads sit in the critical path of every tile. The table itself grows 16x (4 bytes "
        "per token per sequence, against 4 per 16 tokens). Memory waste drops to zero, but it "
        "was under 2% already.\n\n"
        f"Blocks of 256 tokens: each sequence wastes up to 255 slots in its last block "
        f"(internal fragmentation), and a short request occupies a whole block. "
        f"simulate_serving('paged', workload, block_size=256) wastes {_Q13_WASTE_256:.1%} of "
        f"the allocated memory (against {_Q13_WASTE_16:.1%} with 16), fewer requests fit at "
        f"once and the run takes more steps. Copy-on-write also copies 256 tokens instead of "
        f"16. Blocks of 16 keep the waste small and the rows of a tile in long runs."),
    value=_Q13_WASTE_256, rtol=0.05))


# The split kernel's loop, lesson 12's main exercise, has a module of its own; importing it here
# registers it with the lesson's other exercises.
from course_lib.exercises import flash_decoding  # noqa: E402,F401
