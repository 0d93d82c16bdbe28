"""The course's kernels inside Hugging Face transformers: the attention of open models is ours.

Introduced in notebooks/14_llama_capstone.ipynb (LLaMA); the variants of other open models
(padding, sliding windows, softcap, sinks) are lesson 15's (notebooks/15_attention_variants.ipynb).

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

and routes every call to one of the course's kernels (``CALLS`` names the route):

* ``"prefill"`` (the prompt, or any step with more than ``DECODE_MAX_QUERIES`` new tokens, or
  any step whose gradient is needed): ``flash_attn_v2`` (notebook 08), causal bottom-right
  aligned, so a chunk of new tokens after a cache attends correctly; GQA without repeating K/V.
* ``"decode"`` (at most ``DECODE_MAX_QUERIES`` new tokens against a longer cache, no padding;
  a static cache's unused slots are left out by its key counts, ``cache_seqlens``):
  ``flash_decode`` (notebook 12), split-KV with the LSE merge. With the layer's variants where
  it has some, ``flash_decode(..., window_size=, softcap=, sinks=)`` (notebook 15): the window
  is aligned on each sequence's last key, and the splits read only its band (about W + N_q keys
  per sequence, not N_k).
* ``"variants"``: a prefill (as above) with a sliding window that hides keys, a softcap or
  sinks: ``flash_attn_v2(..., window_size=, softcap=, sinks=)`` (notebook 15).
* ``"varlen"``: sequences that use different keys, where ``flash_decode`` does not serve them:
  padding among the keys a step sees (a left-padded batch's prefill and decode steps, until a
  sliding layer's cache has dropped it), and a static cache's unused slots in a prefill whose
  sequences' lengths differ or, compiled, that has a variant, and in any step with a gradient:
  ``flash_attn_varlen`` over key ranges (below).

The variants come as transformers passes them, checked against its eager code (5.24):

* **sliding window** (Mistral on every layer, Gemma 2 and GPT-OSS on every other): the layer
  passes ``sliding_window=W``, and the mask function lets query t see keys t - W < j <= t (W
  keys, its own included): FlashAttention's ``window_size = (W - 1, 0)``, as transformers'
  FlashAttention path passes it. Applied where it hides a key (N_k > W); a sliding layer's
  cache that keeps only the window needs none in its decode steps.
* **softcap** (Gemma 2's ``attn_logit_softcapping``): ``softcap=c``, c·tanh(s / c) on the
  scaled scores, before the mask; ``scaling`` is Gemma 2's query_pre_attn_scalar^-0.5.
* **sinks** (GPT-OSS): ``s_aux``, the layer's (H,) parameter, a logit per head in the softmax's
  denominator with no value (eager concatenates it as one more column and drops its
  probability), cast to fp32; its gradient flows back to the parameter.

The mask. transformers builds one mask per forward (one per layer type) through
``ALL_MASK_ATTENTION_FUNCTIONS`` under the same name; ``course_attention_mask`` turns it into
the keys each sequence uses, without drawing an N_q x N_k mask for the causal and sliding
patterns (``mask_pattern``): ``None`` when every key of the cache is real (the kernels' own
masking is exact); the key counts L_b (B, 1, 1, 1) int32 when sequence b uses the first L_b
keys (a static cache not full yet); else the ranges (B, 1, 1, 4) int32 = (q_lo, q_hi, k_lo,
k_hi): sequence b's real queries and the keys they see, which is how a left-padded batch
(``generate``'s), a right-padded one, or padding inside a sliding layer's cache arrive. The
window is not in the mask: the layer applies its own. The ranges go to ``flash_attn_varlen``
with the batch's rows as they lie: each sequence is three packed pieces (padding before, the
real tokens, padding after), offsets computed on the device and ``max_seqlen`` bounded by N_q
and N_k, so nothing is read back and every shape is static; K and V are copied into the packed
layout (as FlashAttention's transformers integration gathers them). A padding token's own
output is not specified (transformers' eager path averages every key there, FlashAttention's
returns zeros; ours attends among the padding). Other mask functions (packed sequences,
chunked attention, overlays) are drawn and checked; a 4D mask handed to the model directly is
checked by the attention function the same way, against the layer's window.

Refused, with ``NotImplementedError`` and the reason (a silently wrong answer is worse than
none): a padding mask with holes inside a sequence (right padding followed by generated tokens),
packed sequences, chunked attention, any mask that is not causal (or the layer's window) over
one run of keys per sequence; a sliding window on bidirectional attention; attention dropout.

Read-backs. Eagerly, a 2D padding mask is read back once per forward (a few flags: its one-run
check and which form it takes; as transformers' SDPA path reads its mask to skip it), a drawn
mask likewise, and a static cache's L_b range once per forward where the cache is cut to it;
never once per layer. torch.compile (which ``generate`` applies on a GPU with a static cache,
``cache_implementation="static"``) traces both functions: the kernels are ``torch.library``
operators (``course_lib.ops``), the checks inside a graph are device-side assertions and padded
batches take the ranges, so nothing in the compiled path reads a tensor's value back and a
decode step can be one CUDA graph (``generate`` asks for the mask before each step, outside the
graph: with a 2D padding mask that call reads its flags back, without one it reads nothing).

``CALLS`` counts the routes taken by eager calls and ``VARIANTS`` the calls that applied a
``"window"``, a ``"softcap"`` or ``"sinks"``, so a test can show that every attention call of
``generate`` was served by the course and with which variants; a compiled graph shows its
kernels as ``course.*`` nodes instead.

The rest are the capstone's helpers: configs (a small one for the CPU, ~1B parameters for a
GPU; ``small_config`` for tiny LLaMA, Mistral, Gemma 2 and GPT-OSS), a random-weight model,
greedy decoding with a cache, the GPU timing of prefill and
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
from course_lib.ops import flash_attn_v2, flash_attn_varlen, flash_decode

try:
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import (
        AttentionMaskInterface,
        and_masks,
        causal_mask_function,
        sdpa_mask,
        sliding_window_overlay,
    )
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "course_lib.hf needs Hugging Face transformers, an optional extra of the course: "
        "pip install -e '.[hf]' (or pip install transformers)") from e

ATTN_IMPLEMENTATION = "course_kernels"
DECODE_MAX_QUERIES = 16  # at most this many new tokens against a cache: flash_decode
NO_WINDOW = (-1, -1)  # FlashAttention's window_size for no window
CALLS: collections.Counter = collections.Counter()  # eager calls by route
VARIANTS: collections.Counter = collections.Counter()  # eager calls that applied each variant


# ---------------------------------------------------------------------------------------------
# the attention function and its mask
# ---------------------------------------------------------------------------------------------

# transformers' mask functions (masking_utils) that course_attention_mask reads without drawing
# the mask: the causal one, and the sliding window's ``and_masks(sliding_window_overlay(W),
# causal_mask_function)``, under which query q_idx sees key kv_idx iff q_idx - W < kv_idx <=
# q_idx: W keys, its own included, FlashAttention's window_size = (W - 1, 0).
_AND_CODE = and_masks(causal_mask_function).__code__
_WINDOW_CODE = sliding_window_overlay(1).__code__


def _closure(fn) -> dict:
    """The variables a nested function closes over, by name."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def mask_pattern(mask_function):
    """``("causal", None)``, ``("sliding", W)`` or None (any other pattern) for the mask function
    transformers hands a mask interface.

    W is read from the closure of transformers' own sliding-window mask function. Under
    ``torch.compile`` a function made inside the graph has no closure to read: only the plain
    causal one is recognised there, and the caller draws any other mask and checks it."""
    if mask_function is None or mask_function is causal_mask_function:
        return ("causal", None)
    if torch.compiler.is_compiling() or getattr(mask_function, "__code__", None) is not _AND_CODE:
        return None
    parts = _closure(mask_function).get("mask_functions", ())
    if len(parts) == 2 and causal_mask_function in parts:
        window = parts[1] if parts[0] is causal_mask_function else parts[0]
        if getattr(window, "__code__", None) is _WINDOW_CODE:
            return ("sliding", _closure(window)["sliding_window"])
    return None


def course_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                          mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers hands our attention, as the keys each sequence uses: None (every
    key of the cache, no padding), or a small int32 tensor that every layer receives:

    * the key counts L_b, (B, 1, 1, 1): sequence b uses keys [0, L_b) of the cache and its N_q
      queries are the last N_q of those (a static cache not full yet, a right-trimmed cache);
    * the ranges (B, 1, 1, 4) = (q_lo, q_hi, k_lo, k_hi): queries [q_lo, q_hi) of sequence b are
      real tokens and see keys [k_lo, k_hi) of the cache, the last query aligned with the last
      key (left padding, or padding on both sides). Queries outside [q_lo, q_hi) are padding:
      their outputs are not specified (transformers' FlashAttention path returns zeros there,
      its eager path an average over every key).

    The window is not in the mask: a sliding layer passes its ``sliding_window`` to the
    attention function, which applies it (as transformers' FlashAttention path does).

    Called once per forward by ``create_causal_mask`` and ``create_sliding_window_causal_mask``
    (once per layer type), and with a static cache once per step by ``generate``. The causal and
    the sliding-window mask functions (``mask_pattern``) are turned into key ranges without
    drawing an N_q x N_k mask: from the offsets alone when there is no 2D mask (a static cache
    gets L_b = q_offset + N_q - kv_offset, on the device: ``_keys_seen``), or from the 2D padding
    mask (``_keys_of_padding_mask``), which must hold one run of real tokens per sequence (left
    or right padding); eagerly that check and the choice of form read back a few flags, once per
    forward (as transformers' SDPA path reads its mask back to skip it); under ``torch.compile``
    the check is a device-side assertion and the ranges are always used, so nothing is read back.
    Any other mask function (packed sequences, chunked attention, an overlay) is drawn as
    ``sdpa_mask``'s 4D boolean mask and checked, once per forward (``_keys_in_mask``): a mask
    that is causal (or, when transformers passes ``local_size``, a sliding window of that size)
    over one range of keys and queries per sequence becomes that range; any other raises
    ``NotImplementedError`` (under ``torch.compile``, a device-side assertion): the kernels
    cannot express it, and a silently wrong answer is worse than none. A compiled prefill with
    no cache (N_q = N_k, no offsets), for which transformers draws the mask because it cannot
    rule out packed sequences in a graph, gets None after the device checks that it is plain
    causal.
    """
    pattern = mask_pattern(mask_function)
    if pattern is not None and not isinstance(kv_offset, torch.Tensor):
        if attention_mask is None:
            if (not isinstance(q_offset, torch.Tensor)
                    and q_offset + q_length == kv_offset + kv_length):
                return None  # every key of the cache, no padding: the kernels' own masking
            # No padding: the N_q queries are the last of the q_offset + N_q tokens seen, and the
            # cache holds them from kv_offset on. A static cache's offset (a tensor) stays on the
            # device.
            return _keys_seen(batch_size, q_length, q_offset, kv_offset, kwargs.get("device"))
        if attention_mask.ndim == 2:
            return _keys_of_padding_mask(q_length, kv_length, q_offset, kv_offset,
                                         attention_mask.bool(), windowed=pattern[0] != "causal")
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask.bool()
    kwargs.pop("allow_is_causal_skip", None)
    local_size = kwargs.get("local_size")
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     allow_is_causal_skip=False, **kwargs)  # (B, 1, N_q, N_k)
    left = None if local_size is None else local_size - 1
    plain_prefill = (torch.compiler.is_compiling() and attention_mask is None
                     and q_length == kv_length
                     and not any(isinstance(x, torch.Tensor) for x in (q_offset, kv_offset))
                     and q_offset == kv_offset == 0)
    # A compiled prefill with no cache: transformers drew the mask only because it cannot rule
    # out packed sequences in a graph. Checked (on the device) to be the plain causal mask over
    # all N keys, it becomes None: every layer runs the causal forward kernel with no key
    # ranges, as the eager prefill does.
    return _keys_in_mask(mask, q_length, kv_length, left, plain=plain_prefill)[0]


_REFUSED = (
    "course_kernels serves causal attention over one run of real tokens per sequence (left or "
    "right padding, a static cache's unused slots, a sliding window): this attention mask has "
    "packed sequences, holes in a sequence's padding mask, chunked attention or another "
    "pattern. Use attn_implementation='sdpa' for such batches.")
# The last mask checked eagerly: (weak ref to the mask, its version, the window it was checked
# with, weak ref to the key tensor made from it, (min L_b, max L_b) or None). That tensor is what
# course_attention_mask hands every layer, so a layer finds its range by identity. Weak
# references: a tensor kept alive here from one ``generate`` to the next holds a block of
# PyTorch's caching allocator, the next static cache's tensors then get other addresses, and a
# compiled decode step records its CUDA graph anew (its inputs moved).
_checked_mask: tuple = (None, -1, None, None, None)


def _remember(mask, keys: torch.Tensor, length_range, left=None) -> None:
    global _checked_mask
    _checked_mask = (None if mask is None else weakref.ref(mask),
                     -1 if mask is None else _version(mask), left, weakref.ref(keys),
                     length_range)


def _remembered_range(lengths: torch.Tensor):
    ref = _checked_mask[3]
    return _checked_mask[4] if ref is not None and ref() is lengths else None


def _version(t: torch.Tensor):
    # an in-place change bumps a tensor's version; inference tensors have none (identity only)
    return None if t.is_inference() else t._version


def _run(flags: torch.Tensor):
    """(first, one past the last) index of the True entries of each row of flags (B, N), on the
    device; (0, 0) for a row with none."""
    n = flags.shape[-1]
    idx = torch.arange(n, device=flags.device)
    end = torch.where(flags, idx + 1, 0).amax(-1)
    first = torch.minimum(torch.where(flags, idx, n).amin(-1), end)
    return first, end


def _ranges(q_lo, q_hi, k_lo, k_hi) -> torch.Tensor:
    """The ranges form of the keys in use, (B, 1, 1, 4) int32."""
    return torch.stack([q_lo, q_hi, k_lo, k_hi], -1).to(torch.int32).view(-1, 1, 1, 4)


def _ranges_of_lengths(lengths: torch.Tensor, n_q: int) -> torch.Tensor:
    """The key counts L_b (B,) as ranges: every query real, keys [0, L_b)."""
    zeros = torch.zeros_like(lengths)
    return _ranges(zeros, zeros + n_q, zeros, lengths)


def _keys_in_mask(mask: torch.Tensor, n_q: int, n_k: int, left=None, plain: bool = False):
    """(keys, (min L_b, max L_b) or None) for a 4D mask: keys = the L_b (B, 1, 1, 1) int32 if
    ``mask`` is causal over the first L_b keys of each sequence, else the ranges (B, 1, 1, 4)
    if it is causal over keys [k_lo, k_hi) for the queries [q_lo, q_hi) (the rows that see some
    key), bottom-right aligned; with ``left``, also a sliding window of left + 1 keys. Anything
    else raises ``NotImplementedError``. ``plain`` (compiled prefill): the mask must be plain
    causal over all keys, and the keys are None.

    mask (B or 1, 1 or H, N_q, N_k): boolean (True = attend) or additive float (0 = attend).
    Computed on the device. Eagerly, the check, the form and the lengths' range are read back
    together, once per mask (every layer of a forward shares it: one synchronisation per
    forward, not one per layer); under ``torch.compile`` the check is a device-side assertion
    and the form is the ranges, so the compiled graph reads nothing back.
    """
    if mask.ndim != 4 or mask.shape[-2:] != (n_q, n_k):
        raise NotImplementedError(
            f"course_kernels: unexpected attention mask of shape {tuple(mask.shape)}; expected "
            f"(B, 1, {n_q}, {n_k})")
    compiling = torch.compiler.is_compiling()
    ref_mask, version, checked_left, ref_keys, length_range = _checked_mask
    if (not compiling and ref_mask is not None and ref_mask() is mask
            and version == _version(mask) and checked_left == left and ref_keys() is not None):
        return ref_keys(), length_range
    allowed = mask if mask.dtype == torch.bool else mask == 0
    first_row = allowed[:, 0]  # (B, N_q, N_k)
    q_lo, q_hi = _run(first_row.any(-1))  # (B,): the queries that see some key
    k_lo, k_hi = _run(first_row.any(-2))  # (B,): the keys that some query sees
    i = torch.arange(n_q, device=mask.device)[:, None]  # (N_q, 1)
    j = torch.arange(n_k, device=mask.device)[None, :]  # (1, N_k)
    p = i + (k_hi - q_hi)[:, None, None]  # (B, N_q, 1): query i's key position, bottom-right
    expected = ((i >= q_lo[:, None, None]) & (i < q_hi[:, None, None]) & (j <= p)
                & (j >= k_lo[:, None, None]) & (j < k_hi[:, None, None]))  # (B, N_q, N_k)
    if left is not None:
        expected &= j >= p - left
    ok = (allowed == expected[:, None]).all()
    simple = ((q_lo == 0) & (q_hi == n_q) & (k_lo == 0)).all()
    if plain:
        torch._assert_async(ok & simple & (k_hi == n_k).all(), _REFUSED)
        return None, None
    if compiling:
        torch._assert_async(ok, _REFUSED)
        return _ranges(q_lo, q_hi, k_lo, k_hi), None
    ok, simple, lo, hi = torch.stack([ok.to(torch.int64), simple.to(torch.int64), k_hi.min(),
                                      k_hi.max()]).tolist()
    if not ok:
        raise NotImplementedError(_REFUSED)
    if simple:
        keys, length_range = k_hi.to(torch.int32).view(-1, 1, 1, 1), (lo, hi)
    else:
        keys, length_range = _ranges(q_lo, q_hi, k_lo, k_hi), None
    _remember(mask, keys, length_range, left)
    return keys, length_range


def _keys_seen(batch_size: int, n_q: int, q_offset, kv_offset: int, device) -> torch.Tensor:
    """L_b = q_offset + N_q - kv_offset for every sequence, as the (B, 1, 1, 1) int32 tensor the
    layers get. ``generate`` with a static cache asks for a mask eagerly before every step, the
    compiled ones included, with its position as a tensor: computed on the device, nothing is
    read back (drawing the 4D mask and checking it launched about twenty small kernels and
    read the result back, every step)."""
    if isinstance(q_offset, torch.Tensor):
        seen = (q_offset.reshape(-1)[:1] + n_q - kv_offset).to(device=device or q_offset.device,
                                                               dtype=torch.int32)
        return seen.view(1, 1, 1, 1).expand(batch_size, 1, 1, 1).contiguous()
    return _all_lengths(batch_size, q_offset + n_q - kv_offset, device)


def _keys_of_padding_mask(n_q: int, n_k: int, q_offset, kv_offset: int,
                          padding_mask: torch.Tensor, windowed: bool = False):
    """The keys each sequence uses, from the 2D padding mask (B, T) (True: a real token) over the
    q_offset + N_q tokens seen (a mask longer than that, as long as a static cache, has a tail
    that no query sees); the cache holds the tokens from kv_offset on (a sliding layer's cache
    drops the oldest). Each sequence's real tokens must be one run [s_b, e_b): left padding,
    right padding or both; holes raise ``NotImplementedError``.

    Returns None if every sequence uses every key (no padding in the cache, N_q the last
    tokens); the key counts L_b = e_b - kv_offset (B, 1, 1, 1) if no sequence has padding
    inside the cache on the left and either none is padded on the right or a single query (a
    decode step; not ``windowed``: a window is aligned on the query's own position) sees them
    all; else the ranges (B, 1, 1, 4): queries of positions [s_b, e_b) among the N_q, keys of
    those positions in the cache. Eagerly this reads back one small vector, once per forward;
    under ``torch.compile`` nothing (the check is a device-side assertion, the form the ranges).

    transformers 5.17's ``generate`` keeps an all-ones 2D mask (5.24 drops it before the first
    step) and, with a static cache, asks for the mask with it before every step, the compiled
    ones included: a handful of small kernels and one read-back, not the 4D mask drawn over the
    whole cache (about twenty kernels)."""
    compiling = torch.compiler.is_compiling()
    device = padding_mask.device
    n_tokens = padding_mask.shape[-1]
    idx = torch.arange(n_tokens, device=device)
    seen = q_offset + n_q
    if isinstance(seen, torch.Tensor):
        seen = seen.reshape(-1)[:1].to(device)  # (1,)
        real = padding_mask & (idx < seen)
    else:
        real = padding_mask & (idx < seen) if n_tokens > seen else padding_mask
    n_real = real.sum(-1)  # (B,)
    s, e = _run(real)  # (B,): the run of real tokens, if it is one
    empty = n_real == 0
    s = torch.where(empty, seen, s)  # no real token: every query is padding
    e = torch.where(empty, seen, e)
    one_run = ((n_real == e - s) | empty).all()
    if compiling:
        torch._assert_async(one_run, _REFUSED)
    else:
        lengths = (e - kv_offset).clamp(min=0)
        no_left = (s <= kv_offset).all()  # no padding inside the cache on the left
        no_right = (e >= seen).all()
        flags = torch.stack([one_run.to(torch.int64), no_left.to(torch.int64),
                             no_right.to(torch.int64), lengths.min(), lengths.max()])
        one_run, no_left, no_right, lo, hi = flags.tolist()  # the read-back
        if not one_run:
            raise NotImplementedError(_REFUSED)
        if no_left and (no_right or (n_q == 1 and not windowed)):
            if (no_right and not isinstance(q_offset, torch.Tensor)
                    and q_offset + n_q == kv_offset + n_k):
                return None
            lengths = lengths.to(torch.int32).view(-1, 1, 1, 1)
            _remember(None, lengths, (lo, hi))
            return lengths
    return _ranges((s - q_offset).clamp(0, n_q), (e - q_offset).clamp(0, n_q),
                   (s - kv_offset).clamp(0, n_k), (e - kv_offset).clamp(0, n_k))


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


def _layer_window(module, kwargs: dict, causal: bool):
    """The left extent of a sliding layer's window (W - 1 for ``sliding_window`` = W), or None.

    transformers' sliding layers pass ``sliding_window`` to the attention function (Mistral:
    the config's, every layer; Gemma 2 and GPT-OSS: the layer's, None on full layers); a layer
    that does not may carry it as an attribute. Its causal mask function lets query t see keys
    t - W < j <= t (``sliding_window_overlay``): left = W - 1, right = 0."""
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    else:  # (vars(): a missing attribute through nn.Module.__getattr__ costs an exception)
        window = vars(module).get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise NotImplementedError(f"course_kernels: sliding_window={window!r} (layer "
                                  f"{getattr(module, 'layer_idx', '?')}) is not a positive int")
    if not causal:
        raise NotImplementedError(
            "course_kernels: a sliding window on bidirectional attention is not served (its mask, "
            "|q - k| <= W, is another window than the causal one's)")
    return window - 1


def _count(route: str, window, softcap: float, sinks) -> None:
    """Count an eager call: its route in CALLS, the variants it applied in VARIANTS."""
    if torch.compiler.is_compiling():
        return
    CALLS[route] += 1
    for name, applied in (("window", window != NO_WINDOW), ("softcap", softcap != 0.0),
                          ("sinks", sinks is not None)):
        if applied:
            VARIANTS[name] += 1


def _varlen(query, key, value, ranges, scaling, window, softcap, sinks) -> torch.Tensor:
    """Attention over the key ranges of each sequence, (B, N_q, H, D), by ``flash_attn_varlen``
    and no read-back.

    The (B, N, H, D) rows of the batch are packed sequences as they lie: sequence b's rows split
    into three pieces, [0, q_lo) x [0, k_lo) (padding before), [q_lo, q_hi) x [k_lo, k_hi) (the
    real tokens) and [q_hi, N_q) x [k_hi, N_k) (padding after, or a static cache's unused
    slots), so the offsets come from the ranges on the device and every shape is static:
    ``max_seqlen`` = N_q and N_k bound every piece. The padding's pieces attend among themselves
    (their outputs are not specified); an empty piece costs nothing. K and V are copied into
    the packed layout (as FlashAttention's transformers integration gathers them)."""
    B, H, n_q, D = query.shape
    H_kv, n_k = key.shape[1], key.shape[2]
    q_lo, q_hi, k_lo, k_hi = ranges.view(-1, 4).expand(B, 4).unbind(-1)  # (B,) each
    rows = torch.arange(B, device=query.device, dtype=torch.int32)
    zero = rows[:1] * 0

    def offsets(lo, hi, n):  # (3B + 1,) int32
        start = rows * n
        return torch.cat([zero, torch.stack([start + lo, start + hi, start + n], -1).flatten()])

    cu_q, cu_k = offsets(q_lo, q_hi, n_q), offsets(k_lo, k_hi, n_k)
    q = query.transpose(1, 2).reshape(B * n_q, H, D)  # a view when q is (B, N_q, H, D) in memory
    k = key.transpose(1, 2).reshape(B * n_k, H_kv, D)  # the cache is (B, H_kv, N_k, D): a copy
    v = value.transpose(1, 2).reshape(B * n_k, H_kv, D)
    _count("varlen", window, softcap, sinks)
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, n_q, n_k, causal=True, sm_scale=scaling,
                            window_size=window, softcap=softcap, sinks=sinks, validate=False)
    return out.view(B, n_q, H, D)


def _decode(query, key, value, lengths, scaling, window, softcap, sinks) -> torch.Tensor:
    """A decode step, (B, H, N_q, D), by ``flash_decode``: split-KV, causal among the N_q
    queries (the last ones of each sequence's L_b keys, or of N_k), with the variants that
    apply. A window (W - 1, 0) reads only its band of the cache: about W + N_q keys per
    sequence. The variants' keywords are passed only where one applies: a call at the defaults
    is the plain one, which ``flash_decode`` repeats with no checks from the second layer on."""
    variants = {}
    if window != NO_WINDOW:
        variants["window_size"] = window
    if softcap != 0.0:
        variants["softcap"] = softcap
    if sinks is not None:
        variants["sinks"] = sinks
    _count("decode", window, softcap, sinks)
    return flash_decode(query, key, value, cache_seqlens=lengths, sm_scale=scaling, **variants)


def course_attention_forward(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, **kwargs):
    """transformers' attention-function signature, served by the course's Triton kernels.

    query (B, H, N_q, D); key, value (B, H_kv, N_k, D), the whole cache after this step's
    update. Returns (attn_output (B, N_q, H, D), None): no attention weights are ever formed.
    The variants come as transformers passes them: ``sliding_window`` W (``_layer_window``:
    window_size = (W - 1, 0), applied only where it hides a key), ``softcap`` (Gemma 2: c·tanh(s
    / c) on the scaled scores), ``s_aux`` (GPT-OSS's sinks, a per-head logit, cast to fp32; its
    gradient flows back), ``scaling`` (Gemma 2's query_pre_attn_scalar^-0.5). Traceable by
    ``torch.compile(fullgraph=True)``: the kernels are ``torch.library`` operators, and under
    compilation nothing is read back from the device.
    """
    if dropout:
        raise NotImplementedError("course_kernels has no attention dropout: call model.eval() "
                                  "or set config.attention_dropout = 0")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    B, n_q, n_k = query.shape[0], query.shape[2], key.shape[2]
    compiling = torch.compiler.is_compiling()
    left = _layer_window(module, kwargs, causal)
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.float()  # (H,): the kernels keep the softmax in fp32

    def window_for(n_keys):  # a window that hides no key (the last query's key position,
        # n_keys - 1, minus left is <= 0) is left out: the plain kernels serve the call
        return (left, 0) if left is not None and n_keys - 1 > left else NO_WINDOW

    lengths = ranges = length_range = None
    if attention_mask is not None:
        if not causal:
            raise NotImplementedError("course_kernels: a mask on non-causal attention (padding) "
                                      "is not supported")
        if attention_mask.dtype == torch.int32:  # from course_attention_mask (checked there)
            keys = attention_mask
        else:  # a mask made elsewhere (a 4D mask passed to the model): checked here
            keys, length_range = _keys_in_mask(attention_mask, n_q, n_k, left)
        if keys.shape[-1] == 4:
            ranges = keys
        else:
            lengths = keys.view(-1).expand(B)  # (B,)
    variant = window_for(n_k) != NO_WINDOW or softcap != 0.0 or sinks is not None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, sinks))
    # a decode step, with or without the layer's variants (flash_decode has them all)
    decode = (n_q <= DECODE_MAX_QUERIES and n_k > n_q and (causal or n_q == 1)
              and not needs_grad)
    if ranges is not None:
        return _varlen(query, key, value, ranges, scaling, window_for(n_k), softcap, sinks), None
    if lengths is not None and (decode or compiling):
        if decode or (not needs_grad and not variant):
            # A compiled prefill into a static cache cannot cut the cache to the keys in use (a
            # length read back from the device): flash_decode takes the lengths as a tensor.
            # Its window is aligned on each sequence's L_b, so the whole cache's N_k decides
            # only whether one is passed (a window that hides no key of N_k hides none of L_b).
            out = _decode(query, key, value, lengths, scaling, window_for(n_k), softcap, sinks)
            return out.transpose(1, 2).contiguous(), None
        # compiled, a prefill with a variant or a step with a gradient: the ranges, on the device
        ranges = _ranges_of_lengths(lengths, n_q)
        return _varlen(query, key, value, ranges, scaling, window_for(n_k), softcap, sinks), None
    if lengths is not None:  # eager: cut the cache to the keys in use
        lo, n_used = length_range or _lengths_range(attention_mask)  # read back once per mask
        if lo != n_used:  # sequences of different lengths: the ranges
            return _varlen(query, key, value, _ranges_of_lengths(lengths, n_q), scaling,
                           window_for(n_k), softcap, sinks), None
        key, value, n_k = key[:, :, :n_used], value[:, :, :n_used], n_used  # static cache
    window = window_for(n_k)
    if decode:
        out = _decode(query, key, value, None, scaling, window, softcap, sinks)
    elif window != NO_WINDOW or softcap != 0.0 or sinks is not None:
        _count("variants", window, softcap, sinks)
        out = flash_attn_v2(query, key, value, causal=causal, sm_scale=scaling,
                            window_size=window, softcap=softcap, sinks=sinks)
    else:
        _count("prefill", window, softcap, sinks)
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


if __name__ == "__main__":
    raise SystemExit(main())
