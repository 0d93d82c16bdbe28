"""The course's kernels inside Hugging Face transformers: a LLaMA whose attention is ours.

Introduced in notebooks/14_llama_capstone.ipynb.

transformers lets a model's attention be swapped by name: every attention layer of LLaMA (and
of most decoder models) calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
``(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)``, where
query is (B, H, N_q, D) after the rotary embedding and key/value are (B, H_kv, N_k, D): the
*whole* KV cache after this step's update. It must return ``(attn_output, attn_weights)`` with
attn_output (B, N_q, H, D). Importing this module registers ``"course_kernels"``:

    import course_lib.hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="course_kernels")
    # or LlamaConfig(..., attn_implementation="course_kernels"), or
    # model.set_attn_implementation("course_kernels") on a model already built

and routes every call to one of the course's kernels:

* **prefill** (the prompt, or any step with more than ``DECODE_MAX_QUERIES`` new tokens, or any
  step whose gradient is needed): ``flash_attn_v2`` (notebook 08), causal bottom-right aligned,
  so a chunk of new tokens after a cache attends correctly; GQA without repeating K/V.
* **decode** (at most ``DECODE_MAX_QUERIES`` new tokens against a longer cache):
  ``flash_decode`` (notebook 12), split-KV with the LSE merge.

The mask. transformers builds one mask per forward through ``ALL_MASK_ATTENTION_FUNCTIONS``
under the same name; ``course_attention_mask`` returns ``None`` whenever the attention is plain
causal over every key in the cache (no padding: the kernels' own masking is exact), and
otherwise a 4D boolean mask (B, 1, N_q, N_k). The attention function accepts such a mask only
when it is the causal mask over the first L_b keys of each sequence (a static cache that is not
full yet); padding, packed sequences, sliding windows, or any other pattern raise
``NotImplementedError``: the kernels cannot express them, and a silently wrong answer is worse
than none. Dropout, soft-capping and attention sinks are refused the same way.

torch.compile (which ``generate`` applies on a GPU with a static cache) leaves both functions
out of its graphs (``torch.compiler.disable``): the kernels run as they are between the
compiled pieces, and the mask checks may read tensor values.

``CALLS`` counts the routes taken (``"prefill"``, ``"decode"``), so a test can show that the
decode steps of ``generate`` really went through ``flash_decode``.

The rest are the capstone's helpers: configs (a small one for the CPU, ~1B parameters for a
GPU), a random-weight model, greedy decoding with a cache, and the GPU timing of prefill and
per-token decode against SDPA. transformers is an optional extra of the course
(``pip install -e ".[hf]"``); nothing is downloaded: every model here is built from a config.

Measured speed (course_lib/data/llama.json, drawn by ``course_lib.diagrams.capstone``; NVIDIA
H100 80GB HBM3, torch 2.11, the 1.24 B-parameter config in bf16, batch 1; both sides timed the
same way, eager PyTorch, wall clock between ``torch.cuda.synchronize()`` calls: ``time_prefill``
and ``time_decode`` below): prefill of 8192 tokens 54.1 ms with the course kernels against
51.5 ms with SDPA (512 tokens: 10.5 and 10.1 ms); decode 11.3–12.0 ms per token with the
course kernels and 9.7–11.2 ms with SDPA, about the same at 512 and at 8192 tokens of context:
bound by the host's work per token (launches, Python, the cache's copies) more than by the GPU's
attention.
"""
from __future__ import annotations

import collections
import time

import torch

from course_lib._device import DEVICE
from course_lib.kernels.decode import flash_decode
from course_lib.ops import flash_attn_v2

try:
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "course_lib.hf needs Hugging Face transformers, an optional extra of the course: "
        "pip install -e '.[hf]' (or pip install transformers)") from e

ATTN_IMPLEMENTATION = "course_kernels"
DECODE_MAX_QUERIES = 16  # at most this many new tokens against a cache: flash_decode
CALLS: collections.Counter = collections.Counter()


# ---------------------------------------------------------------------------------------------
# the attention function and its mask
# ---------------------------------------------------------------------------------------------

@torch.compiler.disable  # reads the padding mask's values: keep it out of compiled graphs
def course_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                          mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers hands our attention: None for plain causal over the whole cache.

    Called once per forward by ``create_causal_mask`` (and by the sliding-window and
    bidirectional variants). ``attention_mask`` is the 2D (B, past + N_q) padding mask or None.
    None is returned when the N_q queries are the last N_q of the kv_length keys, every key is
    real (no padding) and the pattern is the standard causal one; anything else gets the full
    4D boolean mask from ``sdpa_mask``, which ``course_attention_forward`` inspects.
    """
    from transformers.masking_utils import causal_mask_function

    plain_pattern = mask_function is None or mask_function is causal_mask_function
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask.bool()
        no_padding = attention_mask.shape[-1] == kv_length and bool(attention_mask.all())
    else:
        no_padding = attention_mask is None
    bottom_right = int(q_offset) + q_length == int(kv_offset) + kv_length
    if plain_pattern and no_padding and bottom_right:
        return None
    kwargs.pop("allow_is_causal_skip", None)
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     allow_is_causal_skip=False, **kwargs)


def _keys_in_use(mask: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """L_b per sequence if ``mask`` is causal over the first L_b keys of each; else raise.

    mask (B or 1, 1 or H, N_q, N_k): boolean (True = attend) or additive float (0 = attend).
    """
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if allowed.ndim != 4 or allowed.shape[-2:] != (n_q, n_k):
        raise NotImplementedError(
            f"course_kernels: unexpected attention mask of shape {tuple(mask.shape)}; expected "
            f"(B, 1, {n_q}, {n_k})")
    lengths = allowed[:, :1, -1, :].sum(-1).flatten()  # (B,) keys seen by the last query
    i = torch.arange(n_q, device=mask.device)[:, None]  # (N_q, 1)
    j = torch.arange(n_k, device=mask.device)[None, :]  # (1, N_k)
    expected = j <= lengths[:, None, None] - n_q + i  # (B, N_q, N_k): causal on L_b keys
    if not torch.equal(allowed, expected[:, None].expand_as(allowed)):
        raise NotImplementedError(
            "course_kernels supports causal attention without padding only: this attention mask "
            "has padded tokens, packed sequences or a sliding window. Use "
            "attn_implementation='sdpa' for such batches (or batch sequences of equal length).")
    return lengths


@torch.compiler.disable  # Triton kernels with host-side checks: torch.compile runs them as is
def course_attention_forward(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, **kwargs):
    """transformers' attention-function signature, served by the course's Triton kernels.

    query (B, H, N_q, D); key, value (B, H_kv, N_k, D), the whole cache after this step's
    update. Returns (attn_output (B, N_q, H, D), None): no attention weights are ever formed.
    """
    if dropout:
        raise NotImplementedError("course_kernels has no attention dropout: call model.eval() "
                                  "or set config.attention_dropout = 0")
    for name in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"course_kernels does not support {name}={kwargs[name]!r}")
    if getattr(module, "sliding_window", None) is not None:
        raise NotImplementedError(
            f"course_kernels does not support sliding-window attention (layer "
            f"{getattr(module, 'layer_idx', '?')} has sliding_window={module.sliding_window})")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    n_q, n_k = query.shape[2], key.shape[2]

    lengths = None
    if attention_mask is not None:
        if not causal:
            raise NotImplementedError("course_kernels: a mask on non-causal attention (padding) "
                                      "is not supported")
        lengths = _keys_in_use(attention_mask, n_q, n_k).expand(query.shape[0])  # (B,)

    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    decode = (n_q <= DECODE_MAX_QUERIES and n_k > n_q and (causal or n_q == 1)
              and not needs_grad)
    if decode:
        CALLS["decode"] += 1
        seqlens = None if lengths is None else lengths.to(torch.int32)
        out = flash_decode(query, key, value, cache_seqlens=seqlens, sm_scale=scaling)
    else:
        if lengths is not None:
            n_used = int(lengths.max())
            if int(lengths.min()) != n_used:
                raise NotImplementedError(
                    "course_kernels: sequences of different lengths in one prefill (padding) are "
                    "not supported")
            key, value = key[:, :, :n_used], value[:, :, :n_used]  # static cache: used part
        CALLS["prefill"] += 1
        out = flash_attn_v2(query, key, value, causal=causal, sm_scale=scaling)  # (B, H, N_q, D)
    return out.transpose(1, 2).contiguous(), None  # (B, N_q, H, D)


def register(name: str = ATTN_IMPLEMENTATION, fn=course_attention_forward) -> str:
    """Register an attention function ``fn`` and the course's mask under ``name``.

    Done at import for ``course_attention_forward``; notebook 14 registers its own too. A name
    containing "flash" would make transformers look for a kernel on the Hub: avoid it.
    """
    if "flash" in name:
        raise ValueError(f"{name!r}: transformers treats names with 'flash' as Hub kernels")
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, course_attention_mask)
    return name


register()


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


def make_llama(config: LlamaConfig, attn_implementation: str = ATTN_IMPLEMENTATION,
               dtype=torch.float32, device=None, seed: int = 0) -> LlamaForCausalLM:
    """A LLaMA with seeded random weights, in eval mode. Switch attention later with
    ``model.set_attn_implementation(name)``: same weights, another kernel."""
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


@torch.inference_mode()
def time_prefill(model, input_ids: torch.Tensor, repeats: int = 5) -> float:
    """Median ms of one forward over the prompt (no cache kept): the prefill."""
    times = []
    for r in range(repeats + 1):  # the first run warms up (compiles the kernels)
        _sync()
        t0 = time.perf_counter()
        model(input_ids, use_cache=False, logits_to_keep=1)
        _sync()
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


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
    return sorted(per_token)[len(per_token) // 2]


def benchmark(model, prompt_lengths=(512, 2048, 8192), batch: int = 1, new_tokens: int = 32,
              implementations=(ATTN_IMPLEMENTATION, "sdpa")) -> list[dict]:
    """Prefill ms and decode ms/token for each prompt length and attention implementation.

    One model, its attention switched by name, so the weights are the same for every row.
    """
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for n in prompt_lengths:
        ids = torch.randint(0, model.config.vocab_size, (batch, n), generator=gen)
        ids = ids.to(model.device)
        row = {"prompt": n, "batch": batch}
        for impl in implementations:
            model.set_attn_implementation(impl)
            row[f"prefill_ms_{impl}"] = time_prefill(model, ids)
            row[f"decode_ms_{impl}"] = time_decode(model, ids, new_tokens)
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return rows
