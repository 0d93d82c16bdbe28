"""Exercise of notebooks/14_llama_capstone.ipynb: write a Hugging Face attention function.

The student writes ``my_attention(module, query, key, value, attention_mask, scaling=None,
dropout=0.0, **kwargs)`` with ``flash_attn_v2`` alone, the way ``course_lib.hf`` does for the
prefill. The checker calls it as a LLaMA layer would: query (B, H, N_q, D) after the rotary
embedding, key/value (B, H_kv, N_k, D) the whole cache (N_k >= N_q), no mask; the spec is
causal attention, bottom-right aligned, returned as (B, N_q, H, D).

The reference solution is ``attention_function_solution`` (tested in tests/test_hf.py).
"""
from __future__ import annotations

import torch

from course_lib._device import DEVICE
from course_lib.exercises import Result, check
from course_lib.kernels.flash_v2 import flash_attn_v2
from course_lib.reference import attention

HINT = ("call flash_attn_v2(query, key, value, causal=True, sm_scale=scaling): it handles GQA "
        "and the cache (bottom-right causal). transformers wants (attn_output, attn_weights): "
        "attn_output transposed to (B, N_q, H, D), and None for the weights")


def attention_function_solution(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, **kwargs):
    out = flash_attn_v2(query, key, value, causal=True, sm_scale=scaling)  # (B, H, N_q, D)
    return out.transpose(1, 2), None


class _Layer(torch.nn.Module):
    """What a LLaMA attention layer looks like to the attention function."""

    is_causal = True
    layer_idx = 0

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def check_attention_function(student) -> Result:
    """Prefill, one decode step and a chunk after a cache, with GQA (8 query heads, 2 K/V)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for B, N_q, N_k in ((1, 40, 40), (2, 1, 41), (1, 5, 45)):
        q = torch.randn(B, 8, N_q, 32, generator=gen).to(DEVICE)
        k = torch.randn(B, 2, N_k, 32, generator=gen).to(DEVICE)
        v = torch.randn(B, 2, N_k, 32, generator=gen).to(DEVICE)
        cases.append((q, k, v, 32 ** -0.5))
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

    return check("HF attention function", run, spec, cases, hint=HINT, rtol=1e-4, atol=1e-5)
