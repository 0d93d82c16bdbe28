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
causal over every key in the cache (no padding: the kernels' own masking is exact). Otherwise
it draws the 4D boolean mask (B, 1, N_q, N_k) and checks it, once per forward: the causal mask
over the first L_b keys of each sequence (a static cache that is not full yet) becomes the key
counts L_b, (B, 1, 1, 1) int32, that every layer receives; padding, packed sequences, sliding
windows, or any other pattern raise ``NotImplementedError``: the kernels cannot express them,
and a silently wrong answer is worse than none. A 4D mask handed to the model directly is checked by
the attention function the same way. Dropout, soft-capping and attention sinks are refused.

torch.compile (which ``generate`` applies on a GPU with a static cache,
``cache_implementation="static"``) traces both functions: the kernels are ``torch.library``
operators (``course_lib.ops``) and nothing in the compiled path reads a tensor's value back to
the host, so a decode step can be one CUDA graph.

``CALLS`` counts the routes taken by eager calls (``"prefill"``, ``"decode"``), so a test can
show that the decode steps of ``generate`` really went through ``flash_decode``; a compiled
graph shows its kernels as ``course.flash_decode`` nodes instead.

The rest are the capstone's helpers: configs (a small one for the CPU, ~1B parameters for a
GPU), a random-weight model, greedy decoding with a cache, the GPU timing of prefill and
per-token decode against SDPA, and the stored runs (``python -m course_lib.hf [--compiled]``
writes course_lib/data/llama.json or capstone_compiled.json). transformers is an optional
extra of the course (``pip install -e ".[hf]"``); nothing is downloaded: every model here is
built from a config.

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
2048); notebooks/14_llama_capstone.ipynb, section 7, gives every number, generated from that
file.
"""
from __future__ import annotations

import collections
import contextlib
import time
import weakref

import torch

from course_lib._device import DEVICE
from course_lib.ops import flash_attn_v2, flash_decode

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

def course_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                          mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers hands our attention: None for plain causal over the whole cache,
    else the keys in use per sequence, L_b as a (B, 1, 1, 1) int32 tensor (4D: transformers
    passes a 4D mask on as prepared, as ``generate`` does with a static cache's).

    Called once per forward by ``create_causal_mask`` (and by the sliding-window and
    bidirectional variants), and with a static cache once per step by ``generate``; its result
    goes to every layer. None is returned when the N_q queries are the last N_q of the
    kv_length keys, every key is real (no padding) and the pattern is the standard causal one.
    With no 2D mask (no padding) and the standard pattern, a cache longer than the tokens
    seen (a static cache) gets L_b = q_offset + N_q, computed on the device (``_keys_seen``);
    eagerly, a 2D mask with no padding over exactly the tokens seen gets the same L_b after one
    read-back of a flag (``_keys_without_padding``). Anything else (padding; packed sequences,
    which transformers cannot rule out inside a compiled graph; another pattern) is drawn as
    ``sdpa_mask``'s 4D boolean mask and checked here, once per forward (``_keys_in_use``): a
    causal mask over the first L_b keys of each sequence becomes L_b, any other raises
    ``NotImplementedError`` (under ``torch.compile``, a device-side assertion). A compiled
    prefill with no cache (N_q = N_k, no offsets) whose mask is the plain causal one gets None,
    as eagerly.
    This is the manner of transformers' own FlashAttention path, whose mask function hands the
    attention a compact 2D padding mask instead of a 4D one. Eagerly, knowing that there is no
    padding reads the 2D mask back (one synchronisation per forward, as transformers' SDPA path
    does); under ``torch.compile`` nothing is read back.
    """
    from transformers.masking_utils import causal_mask_function

    plain_pattern = mask_function is None or mask_function is causal_mask_function
    compiling = torch.compiler.is_compiling()
    static_offsets = not any(isinstance(x, torch.Tensor) for x in (q_offset, kv_offset))
    if plain_pattern and static_offsets and q_offset + q_length == kv_offset + kv_length:
        if attention_mask is None:
            return None
        if (attention_mask.ndim == 2 and attention_mask.shape[-1] == kv_length and not compiling
                and bool(attention_mask.bool().all())):
            return None
    if plain_pattern and attention_mask is None and not isinstance(kv_offset, torch.Tensor) \
            and kv_offset == 0:
        # No padding and the plain pattern: the N_q queries are the last of the q_offset + N_q
        # tokens seen, so every sequence uses the first L = q_offset + N_q keys. Nothing to
        # check, and a static cache's offset (a tensor) stays on the device.
        return _keys_seen(batch_size, q_length, q_offset, kwargs.get("device"))
    if (plain_pattern and not compiling and attention_mask is not None
            and attention_mask.ndim == 2 and not isinstance(kv_offset, torch.Tensor)
            and kv_offset == 0):
        lengths = _keys_without_padding(batch_size, q_length, q_offset, attention_mask)
        if lengths is not None:
            return lengths
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask.bool()
    kwargs.pop("allow_is_causal_skip", None)
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     allow_is_causal_skip=False, **kwargs)  # (B, 1, N_q, N_k)
    lengths = _keys_in_use(mask, q_length, kv_length)[0]
    if compiling and static_offsets and q_offset == kv_offset == 0 and q_length == kv_length:
        # A compiled prefill with no cache: transformers drew the mask only because it cannot
        # rule out packed sequences in a graph. Checked (on the device) to be the plain causal
        # mask over all N keys, it becomes None: every layer runs the causal forward kernel
        # with no key counts, as the eager prefill does.
        torch._assert_async((lengths == kv_length).all(), _NOT_CAUSAL_PREFIX)
        return None
    return lengths


_NOT_CAUSAL_PREFIX = (
    "course_kernels supports causal attention without padding only: this attention mask has "
    "padded tokens, packed sequences or a sliding window. Use attn_implementation='sdpa' for "
    "such batches (or batch sequences of equal length).")
# The last mask checked eagerly: (weak ref to the mask, its version, weak ref to L_b (B, 1, 1, 1),
# (min L_b, max L_b)). That L_b is the tensor course_attention_mask hands every layer, so a layer
# finds its range by identity. Weak references: a tensor kept alive here from one ``generate``
# to the next holds a block of PyTorch's caching allocator, the next static cache's tensors then
# get other addresses, and a compiled decode step records its CUDA graph anew (its inputs moved).
_checked_mask: tuple = (None, -1, None, None)


def _remember(mask, lengths: torch.Tensor, length_range) -> None:
    global _checked_mask
    _checked_mask = (None if mask is None else weakref.ref(mask),
                     -1 if mask is None else _version(mask), weakref.ref(lengths), length_range)


def _remembered_range(lengths: torch.Tensor):
    ref = _checked_mask[2]
    return _checked_mask[3] if ref is not None and ref() is lengths else None


def _version(t: torch.Tensor):
    # an in-place change bumps a tensor's version; inference tensors have none (identity only)
    return None if t.is_inference() else t._version


def _keys_in_use(mask: torch.Tensor, n_q: int, n_k: int):
    """(L_b (B, 1, 1, 1) int32, (min L_b, max L_b)) if ``mask`` is causal over the first L_b keys
    of each sequence; else raise. Under ``torch.compile`` the range is None.

    mask (B or 1, 1 or H, N_q, N_k): boolean (True = attend) or additive float (0 = attend).
    The counts are computed on the device. Eagerly, the check that the mask has that pattern
    and the lengths' range are read back together, once per mask (every layer of a forward
    shares it: one synchronisation per forward, not one per layer); under ``torch.compile`` the
    check is a device-side assertion, so the compiled graph reads nothing back.
    """
    if mask.ndim != 4 or mask.shape[-2:] != (n_q, n_k):
        raise NotImplementedError(
            f"course_kernels: unexpected attention mask of shape {tuple(mask.shape)}; expected "
            f"(B, 1, {n_q}, {n_k})")
    compiling = torch.compiler.is_compiling()
    ref_mask, version, ref_lengths, length_range = _checked_mask
    if (not compiling and ref_mask is not None and ref_mask() is mask
            and version == _version(mask) and ref_lengths() is not None):
        return ref_lengths(), length_range
    allowed = mask if mask.dtype == torch.bool else mask == 0
    lengths = allowed[:, 0, -1, :].sum(-1, dtype=torch.int32)  # (B,) keys seen by the last query
    i = torch.arange(n_q, device=mask.device)[:, None]  # (N_q, 1)
    j = torch.arange(n_k, device=mask.device)[None, :]  # (1, N_k)
    expected = j <= lengths[:, None, None] - n_q + i  # (B, N_q, N_k): causal on L_b keys
    ok = (allowed == expected[:, None]).all()
    if compiling:
        torch._assert_async(ok, _NOT_CAUSAL_PREFIX)
        return lengths.view(-1, 1, 1, 1), None
    ok, lo, hi = torch.stack([ok.to(torch.int32), lengths.min(), lengths.max()]).tolist()
    if not ok:
        raise NotImplementedError(_NOT_CAUSAL_PREFIX)
    lengths = lengths.view(-1, 1, 1, 1)  # as course_attention_mask hands it to every layer
    _remember(mask, lengths, (lo, hi))
    return lengths, (lo, hi)


def _keys_seen(batch_size: int, n_q: int, q_offset, device) -> torch.Tensor:
    """L_b = q_offset + N_q for every sequence, as the (B, 1, 1, 1) int32 tensor the layers
    get. ``generate`` with a static cache asks for a mask eagerly before every step, the
    compiled ones included, with its position as a tensor: computed on the device, nothing is
    read back (drawing the 4D mask and checking it launched about twenty small kernels and
    read the result back, every step)."""
    if isinstance(q_offset, torch.Tensor):
        seen = (q_offset.reshape(-1)[:1] + n_q).to(device=device or q_offset.device,
                                                   dtype=torch.int32)
        return seen.view(1, 1, 1, 1).expand(batch_size, 1, 1, 1).contiguous()
    return _all_lengths(batch_size, q_offset + n_q, device)


def _keys_without_padding(batch_size: int, n_q: int, q_offset, padding_mask: torch.Tensor):
    """L_b = L for every sequence, as a (B, 1, 1, 1) int32 tensor, if the 2D mask (B, L) has no
    padding and covers exactly the q_offset + N_q tokens seen; else None (the caller then draws
    the 4D mask and checks it). Eager only: one read-back, of one flag.

    transformers 5.17's ``generate`` keeps an all-ones 2D mask (5.24 drops it before the first
    step) and, with a static cache, asks for the mask with it before every step, the compiled
    ones included. Drawing the 4D mask over the whole cache and checking it took about twenty
    small kernels and a read-back per token; this is at most five and a read-back of one flag."""
    n_seen = padding_mask.shape[-1]
    if isinstance(q_offset, torch.Tensor):  # a static cache's position, on the device
        ok = padding_mask.all() & (q_offset.reshape(-1)[0] + n_q == n_seen)
    elif q_offset + n_q == n_seen:
        ok = padding_mask.all()
    else:
        return None
    if not ok.item():  # the read-back
        return None
    return _all_lengths(batch_size, n_seen, padding_mask.device)


def _all_lengths(batch_size: int, n: int, device) -> torch.Tensor:
    """L_b = n for every sequence, (B, 1, 1, 1) int32; eagerly, its range (n, n) is remembered
    for the layers (``_lengths_range``)."""
    lengths = torch.full((batch_size, 1, 1, 1), n, dtype=torch.int32, device=device)
    if not torch.compiler.is_compiling():
        _remember(None, lengths, (n, n))
    return lengths


def _lengths_range(lengths: torch.Tensor):
    """(min L_b, max L_b) of the key counts ``course_attention_mask`` made: known from its check
    when eager, or read back once (every layer gets the same tensor); None under
    ``torch.compile``."""
    if torch.compiler.is_compiling():
        return None
    known = _remembered_range(lengths)
    if known is not None:
        return known
    lo, hi = torch.stack([lengths.min(), lengths.max()]).tolist()  # read back, once per mask
    _remember(None, lengths, (lo, hi))
    return lo, hi


def course_attention_forward(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, **kwargs):
    """transformers' attention-function signature, served by the course's Triton kernels.

    query (B, H, N_q, D); key, value (B, H_kv, N_k, D), the whole cache after this step's
    update. Returns (attn_output (B, N_q, H, D), None): no attention weights are ever formed.
    Traceable by ``torch.compile(fullgraph=True)``: the kernels are the operators
    ``course::flash_attn_fwd`` and ``course::flash_decode``, and under compilation nothing is
    read back from the device.
    """
    if dropout:
        raise NotImplementedError("course_kernels has no attention dropout: call model.eval() "
                                  "or set config.attention_dropout = 0")
    for name in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"course_kernels does not support {name}={kwargs[name]!r}")
    # (vars(): a missing attribute through nn.Module.__getattr__ costs an exception per layer)
    if vars(module).get("sliding_window") is not None:
        raise NotImplementedError(
            f"course_kernels does not support sliding-window attention (layer "
            f"{getattr(module, 'layer_idx', '?')} has sliding_window={module.sliding_window})")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    n_q, n_k = query.shape[2], key.shape[2]
    compiling = torch.compiler.is_compiling()

    lengths = None
    if attention_mask is not None:
        if not causal:
            raise NotImplementedError("course_kernels: a mask on non-causal attention (padding) "
                                      "is not supported")
        if attention_mask.dtype == torch.int32:  # L_b from course_attention_mask (checked)
            lengths, length_range = attention_mask, None  # the range: read when needed
        else:  # a mask made elsewhere (a 4D mask passed to the model): checked here
            lengths, length_range = _keys_in_use(attention_mask, n_q, n_k)
        lengths = lengths.view(-1).expand(query.shape[0])  # (B,)

    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    decode = (n_q <= DECODE_MAX_QUERIES and n_k > n_q and (causal or n_q == 1)
              and not needs_grad)
    if decode or (lengths is not None and compiling and not needs_grad):
        # A compiled prefill into a static cache cannot cut the cache to the keys in use (a
        # length read back from the device): flash_decode takes the lengths as a tensor.
        if not compiling:
            CALLS["decode"] += 1
        out = flash_decode(query, key, value, cache_seqlens=lengths, sm_scale=scaling)
    else:
        if lengths is not None:
            if compiling:
                raise NotImplementedError("course_kernels: a gradient through a masked "
                                          "(static-cache) attention is not supported")
            # read back once per mask, not once per layer
            lo, n_used = length_range or _lengths_range(attention_mask)
            if lo != n_used:
                raise NotImplementedError(
                    "course_kernels: sequences of different lengths in one prefill (padding) are "
                    "not supported")
            key, value = key[:, :, :n_used], value[:, :, :n_used]  # static cache: used part
        if not compiling:
            CALLS["prefill"] += 1
        out = flash_attn_v2(query, key, value, causal=causal, sm_scale=scaling)  # (B, H, N_q, D)
    # O is laid out as q is, (B, N_q, H, D) in memory (ops.flash_attn_v2): no copy here
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


if __name__ == "__main__":
    raise SystemExit(main())
