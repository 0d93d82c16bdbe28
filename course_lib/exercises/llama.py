"""Exercise and think-questions of notebooks/14_llama_capstone.ipynb.

``attention_function`` (Python): the student writes ``my_attention(module, query, key, value,
attention_mask, scaling=None, dropout=0.0, **kwargs)`` with ``flash_attn_v2`` alone, the way
``course_lib.hf`` does for the prefill. The checker calls it as a LLaMA layer would: query
(B, H, N_q, D) after the rotary embedding, key/value (B, H_kv, N_k, D) the whole cache
(N_k >= N_q), no mask; the spec is causal attention, bottom-right aligned, returned as
(B, N_q, H, D).

The reference solution is ``attention_function_solution`` (also tested in tests/test_hf.py).
"""
from __future__ import annotations

import torch

from course_lib._device import DEVICE
from course_lib.exercises import Exercise, Mistake, Question, check, register
from course_lib.ops import flash_attn_v2
from course_lib.reference import attention


# --- what the notebook shows ----------------------------------------------------------------
def my_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
    # TODO: return (attn_output (B, N_q, H, D), None)
    raise NotImplementedError


# --- the reference and the mistakes students make ------------------------------------------
def attention_function_solution(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, **kwargs):
    out = flash_attn_v2(query, key, value, causal=True, sm_scale=scaling)  # (B, H, N_q, D)
    return out.transpose(1, 2), None


def _attn_no_transpose(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    return flash_attn_v2(query, key, value, causal=True, sm_scale=scaling), None


def _attn_not_causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    return flash_attn_v2(query, key, value, causal=False, sm_scale=scaling).transpose(1, 2), None


def _attn_top_left(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """Causal from the top-left corner: right for a prompt, wrong after a cache."""
    n_q, n_k = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, 1)
    v = value.repeat_interleave(groups, 1)
    s = query @ k.transpose(-1, -2) * scaling
    seen = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril()
    s = s.masked_fill(~seen, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2), None


def _attn_default_scale(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """``scaling`` ignored: right for LLaMA (1/√D), wrong for a model that scales otherwise."""
    return flash_attn_v2(query, key, value, causal=True).transpose(1, 2), None


def _attn_tensor_only(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    return flash_attn_v2(query, key, value, causal=True, sm_scale=scaling).transpose(1, 2)


class _Layer(torch.nn.Module):
    """What a LLaMA attention layer looks like to the attention function."""

    is_causal = True
    layer_idx = 0

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


HINTS = (
    "flash_attn_v2 already handles what a LLaMA layer hands you: GQA (8 query heads on 2 K/V "
    "heads) and a cache longer than the queries, with causality counted from the last key. "
    "Which of its arguments say that, and which is the scale?",
    "transformers wants the output token-major, (B, N_q, H, D): the kernel returns the "
    "query's layout (B, H, N_q, D). Swap two dimensions.",
    "the function returns a pair (attn_output, attn_weights); a fused kernel never forms the "
    "weights, so the second item is None.",
)
NUDGES = {
    "shape": HINTS[1],
    "attn_weights": HINTS[2],
    "not D^-1/2": "the only case that fails is the one whose scaling is not 1/√D: transformers "
                  "hands every call the model's scaling (Gemma 2 uses its query_pre_attn_scalar,"
                  " not D). Is yours the one the kernel uses?",
    "a decode step": "the decode step fails: one query against 41 keys sees all of them. With "
               "causal masking, which keys does query i see when N_k > N_q?",
}


def check_attention_function(student, show: bool = True):
    """Prefill, one decode step and a chunk after a cache, with GQA (8 query heads, 2 K/V)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for B, N_q, N_k, scaling in ((1, 40, 40, 32 ** -0.5), (2, 1, 41, 32 ** -0.5),
                                 (1, 5, 45, 32 ** -0.5), (1, 7, 20, 0.3)):
        q = torch.randn(B, 8, N_q, 32, generator=gen).to(DEVICE)
        k = torch.randn(B, 2, N_k, 32, generator=gen).to(DEVICE)
        v = torch.randn(B, 2, N_k, 32, generator=gen).to(DEVICE)
        cases.append((q, k, v, scaling))
    layer = _Layer(groups=4)

    def run(q, k, v, scaling):
        res = student(layer, q, k, v, None, scaling=scaling, dropout=0.0)
        if res is None:
            return None
        if not (isinstance(res, tuple) and len(res) == 2):
            raise TypeError(f"return (attn_output, attn_weights), got {type(res).__name__}")
        return res[0]

    def spec(q, k, v, scaling):
        return attention(q, k, v, causal=True, sm_scale=scaling).transpose(1, 2)

    def describe(c):
        q, k = c[0], c[1]
        what = {1: "a decode step"}.get(q.shape[2], "a prompt" if q.shape[2] == k.shape[2]
                                        else "a chunk after a cache")
        scale = "" if abs(c[3] - q.shape[-1] ** -0.5) < 1e-12 else \
            f", scaling = {c[3]} (not D^-1/2 = {q.shape[-1] ** -0.5:.3f})"
        return (f"{what}: B = {q.shape[0]}, N_q = {q.shape[2]}, N_k = {k.shape[2]}, "
                f"H = {q.shape[1]}, H_kv = {k.shape[1]}{scale}")

    return check("attention_function", run, spec, cases, hints=HINTS, nudges=NUDGES,
                 rtol=1e-4, atol=1e-5, show=show, describe=describe)


register(Exercise(
    name="attention_function", lesson="14_llama_capstone", kind="python",
    writes="a transformers attention function on flash_attn_v2", lines=2,
    check=check_attention_function, solution=attention_function_solution, stub=my_attention,
    mistakes=(Mistake("the output left in (B, H, N_q, D)", _attn_no_transpose, "shape"),
              Mistake("causal=False", _attn_not_causal, "values differ"),
              Mistake("the model's scaling ignored", _attn_default_scale, "not D^-1/2"),
              Mistake("causal from the top-left corner", _attn_top_left, "a decode step"),
              Mistake("the tensor alone, not (attn_output, None)", _attn_tensor_only,
                      "attn_weights")),
    hints=HINTS))


# --- think-questions ------------------------------------------------------------------------
register(Question(
    name="q14_padding", lesson="14_llama_capstone",
    asks="course_lib.hf serves a left-padded batch by handing flash_attn_varlen three pieces per "
         "sequence, the padding included. Why not pack only the real tokens: what would that "
         "cost, eagerly and under torch.compile? And why is a padding mask with a hole still "
         "refused: what would it take to serve one?",
    answer=(
        "Packing only the real tokens needs their number, a value held in the mask: the "
        "packed tensors' length would have to be read back to the host before a layer could "
        "allocate them, and under torch.compile a shape that depends on a tensor's values "
        "breaks the graph or specialises it to each total, while a CUDA graph replays fixed "
        "shapes only. It also needs a gather of the real rows of Q, K and V and a scatter of "
        "O back into (B, N_q, H, D).\n\n"
        "Cutting the rows where they lie avoids that. The batch's (B, N_q, H, D) query rows, "
        "flattened, are already packed sequences: sequence b's rows b·N_q + [0, q_lo), b·N_q "
        "+ [q_lo, q_hi) and b·N_q + [q_hi, N_q) are its padding before, its real tokens and "
        "its padding after (its key rows likewise, with k_lo, k_hi and N_k). The offsets "
        "cu_seqlens are arithmetic on the four numbers of the ranges, done on the device, "
        "and every shape is set by B, N_q and N_k (max_seqlen = N_q and N_k bound every "
        "piece). "
        "So the layers read nothing back, nor does a compiled graph (a check of the mask "
        "inside it is a device-side assertion); eagerly, the mask function reads a few flags "
        "back once per forward. O comes out as (B·N_q, H, D), already in place; K and V "
        "are still copied into the packed layout, because the cache is (B, H_kv, N_k, D). The "
        "price is the padding's own pieces, which attend among themselves (outputs nobody "
        "reads): in a left-padded prompt, a q_lo × k_lo causal block per sequence; in a "
        "decode step nothing, since the one query is real and the padding's query pieces are "
        "empty.\n\n"
        "A hole (right padding followed by generated tokens, or tokens masked out in the "
        "middle) splits a sequence's real tokens into two runs. A query then sees a union of "
        "runs of keys, and a packed sequence is one run: each query row belongs to exactly "
        "one piece and sees keys of that piece only. The course's kernels mask by position "
        "alone (causal, a window, a sequence's start and end), never key by key. Serving a "
        "hole takes either a mask the kernel reads key by key (a tile of the boolean mask "
        "loaded beside each K tile, as a masked SDPA call reads its mask; FlexAttention "
        "generates such a kernel from a mask_mod), or a cache compacted so that the real "
        "keys form one run again (a gather whose indices depend on the mask). Until then "
        "course_attention_mask raises NotImplementedError: a silently wrong answer is worse "
        "than none."),
))

def _route_answer() -> str:
    """The worked answer of q14_route, with the numbers computed (and the stored run's)."""
    from course_lib import hardware
    from course_lib.bench.common import load_result
    from course_lib.iomodel import decode as io

    layers, h, h_kv, d, n = 16, 32, 8, 64, 8192  # Llama-3.2-1B's shape, 8192 cached tokens
    kv = io.decode_attention_io(B=1, H=h, H_kv=h_kv, N_q=1, L=n, D=d)["kv_bytes"]
    gpu = hardware.get_gpu("H100-SXM")
    layer_us = kv / (gpu.hbm_tbs * 1e12) * 1e6
    stored = load_result("llama") or {}
    row = next((r for r in stored.get("rows", []) if r.get("prompt") == n), None)
    step = next((r for r in stored.get("decode_step", []) if r.get("N_k") == n), None)
    gpu_name = stored.get("environment", {}).get("gpu", "a GPU")
    diff_ms = (None if step is None else
               (step["flash_attn_v2_us"] - step["flash_decode_us"]) * layers / 1e3)
    measured = ("section 6's attention-alone table measures by how much" if step is None else
                f"the stored attention-alone table ({gpu_name}) measures it at "
                f"{step['flash_attn_v2_us']:.1f} µs against flash_decode's "
                f"{step['flash_decode_us']:.1f} µs per layer: {diff_ms:.2f} ms per token over "
                f"{layers} layers")
    per_token = ("" if row is None else
                 f"The stored run took {row['decode_ms_course_kernels']:.2f} ms per token with "
                 f"the course's kernels and {row['decode_ms_sdpa']:.2f} ms with SDPA at {n} "
                 f"tokens, mostly kernel launches, Python and the DynamicCache's copies. ")
    share = ("a minor part" if row is None or diff_ms is None else
             f"about {diff_ms / row['decode_ms_course_kernels']:.0%}")
    return (
        f"Not much. At {n} cached tokens one layer's attention reads K and V once: "
        f"{h_kv} K/V heads × {n} keys × {d} dims × 2 bytes × 2 (K and V) = "
        f"{kv / 2**20:.0f} MiB, {layer_us:.1f} µs at the {gpu.hbm_tbs} TB/s of an H100 "
        f"SXM; {layers} layers make {layers * layer_us / 1e3:.2f} ms per token at the memory "
        f"floor. flash_attn_v2 used for decoding launches only B·H = {h} programs, each "
        f"walking all {n} keys alone, so it stays well below that bandwidth: {measured}. "
        f"{per_token}So the route can change at most {share} of the per-token time in eager "
        f"PyTorch, and less where the kernel's extra GPU time hides behind the host's work "
        f"(section 6: the GPU mostly waits for the host). "
        f"It matters once the rest is removed (CUDA graphs, a static cache, larger batches, "
        f"longer contexts), where attention's share grows with the cache.")


register(Question(
    name="q14_route", lesson="14_llama_capstone",
    asks="With every call routed to flash_attn_v2 (course_lib.hf.attention.DECODE_MAX_QUERIES "
         "= 0; hf.DECODE_MAX_QUERIES is a copy), how much of the "
         "per-token decode time of the 1B model at 8192 tokens can the attention kernel "
         "change?",
    answer=_route_answer(),
))
